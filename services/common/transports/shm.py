"""Same-host weight transport: tensors written once into POSIX shared memory, references on the wire.

The sender (trainer rank 0) writes each tensor once into a segment file under /dev/shm, its checksum summed
in the same pass (services/common/checksum.py `copy_word_sum`), and streams the same
`Rollout.UpdateWeights` buckets and commit as the gRPC transport, except that each bucket carries a
`SharedMemoryRef` (segment path, id, offsets) instead of the bytes. The replica maps the segment
(`SegmentCache`) and the engine copies each bucket straight from the mapping into its parameters while the
trainer writes the next one (no protobuf copy, no staging copy), checking each tensor (checksum,
finiteness) in the same pass (services/rollout/weight_checks.py); the commit then checks completeness and the
chained checksum. Both copies store around the cache, so the two run side by side at the speed of one
(`_wordcopy.c`). Buckets default to 64 MiB (each is one engine call on the replica; smaller ones measured
slower).

Segment lifetime (no /dev/shm leak):
- the segment's name exists only while a push runs: the sender unlinks it when the push ends, whatever the
  outcome; mappings survive an unlink, so the sender and the replicas that acknowledged keep theirs;
- the next push rewrites the same mapping (the pages are already there: first-touch page faults cost more
  than the copy on these machines) when every target acknowledged the segment before; otherwise (a new
  target, a failure, a larger model) the old segment is dropped and a new one is created, so a replica that
  failed or timed out is never reading bytes being rewritten;
- a sender that crashed mid-push leaves a name behind: names embed the creator's pid, and every new sender
  removes the names of dead pids first (`sweep_stale_segments`). A replica holds its mapping (one model's
  bytes) until a newer segment arrives or it exits.
Limit: the sender and the replicas must share /dev/shm (same host, same IPC namespace); a replica that
cannot open the segment answers FAILED_PRECONDITION, and the coordinator then uses gRPC for it.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import chain, copy_word_sum, fold
from services.common.tensors import dtype_code
from services.common.transports.base import TargetFailure, WeightAck
from services.common.transports.grpc_stream import GrpcStreamTransport

SHM_DIR = Path("/dev/shm")
DEFAULT_SHM_BUCKET_BYTES = 64 << 20
SEGMENT_PREFIX = "rlfabric-weights-"
_ALIGN = 64


def _segment_pid(path: Path) -> int | None:
    head = path.name[len(SEGMENT_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[Path]:
    """Unlinks the segments whose creator process is gone; returns them."""
    removed = []
    for path in directory.glob(SEGMENT_PREFIX + "*"):
        pid = _segment_pid(path)
        if pid is not None and not _alive(pid):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


class Segment:
    """A shared-memory segment this process created and keeps mapped (see module docstring)."""

    def __init__(self, size: int, directory: Path = SHM_DIR) -> None:
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.path = directory / f"{SEGMENT_PREFIX}{self.id}"
        self.size = size
        self.mapped_by: set[str] = set()
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes with it

    def write(self, offset: int, tensor: torch.Tensor) -> int:
        """Copies `tensor`'s bytes to `offset`; returns the checksum of the bytes that landed."""
        src = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        n = src.numel()
        if offset + n > self.size:
            raise ValueError(f"segment of {self.size} bytes cannot hold {n} bytes at offset {offset}: the "
                             "sender's total_bytes understated the tensors it was given")
        return fold(copy_word_sum(torch.from_numpy(self.array[offset:offset + n]), src), n)


_LOCK = threading.Lock()
_CURRENT: list[Segment] = []  # the segment kept for the next push (at most one)
_SWEPT: list[bool] = []


def _close_current() -> None:
    while _CURRENT:
        _CURRENT.pop().close()


atexit.register(_close_current)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmTransport(GrpcStreamTransport):
    """Writes the tensors into a shared-memory segment and streams references to them (module docstring).

    Takes GrpcStreamTransport's arguments, plus `num_tensors` (an upper bound, to size the alignment
    padding). With `total_bytes` 0, `send` reads the tensors first to size the segment.
    """

    def __init__(self, targets, *, num_tensors: int = 0, **kwargs) -> None:
        # Each bucket is one engine call on the replica (a few ms of vLLM's load_weights set-up each), and no
        # message buffer is allocated here: larger buckets than the gRPC default measured faster.
        kwargs["bucket_bytes"] = kwargs.get("bucket_bytes") or DEFAULT_SHM_BUCKET_BYTES
        super().__init__(targets, **kwargs)
        self.num_tensors = num_tensors
        self.segment: Segment | None = None

    def _segment(self, needed: int) -> Segment:
        if not _SWEPT:
            sweep_stale_segments()
            _SWEPT.append(True)
        if _CURRENT:
            seg = _CURRENT[0]
            if seg.size >= needed and set(self.targets) <= seg.mapped_by:
                return seg
            _close_current()
        seg = Segment(needed)
        _CURRENT.append(seg)
        return seg

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[
            str, WeightAck | TargetFailure]:
        with _LOCK:
            total, count = self.total_bytes, self.num_tensors
            if not total:
                named_tensors = list(named_tensors)
                total = sum(t.numel() * t.element_size() for _, t in named_tensors)
                count = len(named_tensors)
            self.segment = self._segment(max(_ALIGN, total + _ALIGN * max(count, 1)))
            ok = False
            try:
                outcomes = super().send(version, named_tensors)
                ok = all(isinstance(o, WeightAck) for o in outcomes.values())
                return outcomes
            finally:
                if ok:
                    self.segment.mapped_by.update(self.targets)
                    self.segment.unlink()
                else:
                    _close_current()  # nobody may read a segment that gets rewritten: start afresh next time

    def buckets(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[
            tuple[rollout_pb2.WeightUpdateChunk, int]]:
        """Writes each tensor into the segment; yields bucket chunks of references and their payload sizes."""
        seg = self.segment
        assert seg is not None, "send() picks the segment"
        chunk, size, index, offset, sums = None, 0, 0, 0, []
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if chunk is not None and size + nbytes > self.bucket_bytes:
                yield self._seal_refs(chunk, sums), size
                chunk, size, index, sums = None, 0, index + 1, []
            if chunk is None:
                chunk = rollout_pb2.WeightUpdateChunk()
                chunk.bucket.version, chunk.bucket.index = version, index
                chunk.bucket.shm.path, chunk.bucket.shm.segment_id = str(seg.path), seg.id
                chunk.bucket.shm.size = seg.size
            named = chunk.bucket.tensors.add()
            named.name = name
            named.tensor.dtype = dtype_code(tensor.dtype)
            named.tensor.shape.extend(tensor.shape)
            chunk.bucket.shm.offsets.append(offset)
            sums.append(seg.write(offset, tensor))
            offset = _aligned(offset + nbytes)
            size += nbytes
        if chunk is not None:
            yield self._seal_refs(chunk, sums), size

    @staticmethod
    def _seal_refs(chunk: rollout_pb2.WeightUpdateChunk, sums: list[int]) -> rollout_pb2.WeightUpdateChunk:
        chunk.bucket.checksum = chain(sums)
        return chunk


class SegmentOpenError(OSError):
    """The replica cannot open the segment a bucket names (not the sender's host, or /dev/shm not shared)."""


class SegmentCache:
    """The replica's side: keeps the mapping of the latest segment it read, keyed by segment id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._id: str | None = None
        self._array: np.ndarray | None = None

    def array(self, ref: common_pb2.SharedMemoryRef) -> np.ndarray:
        """The segment's bytes (a uint8 array over the mapping); raises SegmentOpenError."""
        with self._lock:
            if ref.segment_id != self._id or self._array is None:
                self._array, self._id = self._open(ref), ref.segment_id
            if self._array.nbytes != ref.size:
                raise SegmentOpenError(f"segment {ref.segment_id} maps {self._array.nbytes} bytes, the bucket "
                                       f"says {ref.size}")
            return self._array

    @staticmethod
    def _open(ref: common_pb2.SharedMemoryRef) -> np.ndarray:
        path = Path(ref.path)
        if path.parent != SHM_DIR or not path.name.startswith(SEGMENT_PREFIX):
            raise SegmentOpenError(f"segment path {ref.path!r} is not a {SHM_DIR}/{SEGMENT_PREFIX}* file")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink planted under the name is refused
        except OSError as e:
            raise SegmentOpenError(f"cannot open shared-memory segment {ref.path}: {e.strerror}; the shm "
                                   "transport needs the trainer on this host, sharing /dev/shm") from e
        try:
            if os.fstat(fd).st_size != ref.size:
                raise SegmentOpenError(f"segment {ref.path} has {os.fstat(fd).st_size} bytes, the bucket says "
                                       f"{ref.size}")
            # Writable only so that torch views need no copy or warning; the replica never writes to it.
            return np.frombuffer(mmap.mmap(fd, ref.size), dtype=np.uint8)
        finally:
            os.close(fd)
