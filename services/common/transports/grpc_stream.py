"""The default weight transport: `Rollout.UpdateWeights` client streams of checksummed buckets, one per target.

Tensors are packed, in the order given, into `WeightBucket`s of about `bucket_bytes` (default 16 MiB; a
larger tensor travels alone), each with its checksum (services/common/checksum.py, taken from the source
bytes while they are copied into the message: wire.py), then one `WeightCommit` carrying the combined
checksum. Every target gets its own concurrent stream; a bucket is packed once and shared by all streams,
and at most `max_queued_buckets` wait per target, so the sender holds a few buckets, never the whole model.
A target's acknowledgement must name the version and the combined checksum that were sent. A target that
fails (refuses a bucket, drops the connection) or misses the deadline is reported as a `TargetFailure` and
its stream is cancelled; that receiver keeps serving its previous weights and version
(it applies buckets as they arrive but restores them unless the commit verifies: services/rollout/update_stream.py),
and the other targets go on.

Limits: one tensor must fit in one gRPC message (services/common/wire_limits.py MAX_MESSAGE_BYTES). Same-host
replicas get the shared-memory transport (shm.py), which reuses these streams for references only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import torch

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import combine_checksums
from services.common.client import make_channel
from services.common.deadlines import DEFAULT_DEADLINE_S
from services.common.tensors import dtype_code
from services.common.transports.base import TargetFailure, WeightAck, WeightTransport, checked_targets
from services.common.transports.wire import PackedChunk, serialize
from services.common.wire_limits import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

# 16 MiB: glibc serves buffers up to 32 MiB from its heap once freed ones are reused, larger ones are fresh
# mmaps whose first-touch page faults cost more than the copy on these VMs (64 MiB buckets measured slower).
DEFAULT_BUCKET_BYTES = 16 << 20
_UPDATE_WEIGHTS = f"/{rollout_pb2.DESCRIPTOR.services_by_name['Rollout'].full_name}/UpdateWeights"
# Room for names, shapes and framing next to the tensor bytes in one message.
_MAX_TENSOR_BYTES = MAX_MESSAGE_BYTES - (1 << 20)

# (target, bytes_sent, bytes_total, done, acked checksum)
Progress = Callable[[str, int, int, bool, int], None]
# Test hook: (target, chunk) -> the chunk that target receives (for example with a flipped byte).
Tamper = Callable[[str, rollout_pb2.WeightUpdateChunk], rollout_pb2.WeightUpdateChunk]


def _no_progress(_target: str, _sent: int, _total: int, _done: bool, _checksum: int) -> None:
    pass


def _append(chunk: PackedChunk, name: str, tensor: torch.Tensor) -> None:
    """Adds `tensor`: metadata in the message, bytes as a view (wire.py)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    named = chunk.message.bucket.tensors.add()
    named.name = name
    named.tensor.dtype = dtype_code(flat.dtype)
    named.tensor.shape.extend(tensor.shape)
    chunk.views.append(raw)


class _TargetStream:
    """One UpdateWeights call fed from a bounded queue."""

    def __init__(self, target: str, *, token: str | None, timeout_s: float, max_queued: int, total: int,
                 on_progress: Progress) -> None:
        self.target = target
        self.total = total
        self.sent = 0
        self.failure: TargetFailure | None = None
        self._on_progress = on_progress
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._stop = threading.Event()
        self._channel = make_channel(target, token=token)
        update = self._channel.stream_unary(_UPDATE_WEIGHTS, request_serializer=serialize,
                                            response_deserializer=rollout_pb2.WeightUpdateAck.FromString)
        self.call = update.future(self._requests(), timeout=timeout_s)

    def _requests(self) -> Iterator[rollout_pb2.WeightUpdateChunk]:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                return
            chunk, nbytes = item
            yield chunk
            # gRPC asks for the next message once this one is handed to the transport.
            self.sent += nbytes
            if nbytes:
                self._on_progress(self.target, self.sent, max(self.total, self.sent), False, 0)

    def alive(self) -> bool:
        return self.failure is None and not self.call.done()

    def offer(self, item: tuple[rollout_pb2.WeightUpdateChunk, int] | None, deadline: float) -> None:
        """Queue a chunk (None ends the stream); waits while the queue is full, until the deadline."""
        while self.alive():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    self.fail("DEADLINE_EXCEEDED", "the push outlived its deadline while this target was receiving")

    def fail(self, code: str, message: str) -> None:
        if self.failure is None:
            self.failure = TargetFailure(self.target, code, message)
        self.close()

    def outcome(self, version: int, checksum: int, deadline: float) -> WeightAck | TargetFailure:
        if self.failure is None:
            try:
                ack = self.call.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                self.fail("DEADLINE_EXCEEDED", "no acknowledgement before the deadline")
            except grpc.RpcError as e:
                self.fail(e.code().name, e.details() or "")
            except grpc.FutureCancelledError:
                self.fail("CANCELLED", "the stream was cancelled")
            else:
                if ack.version != version or ack.checksum != checksum:
                    self.fail("DATA_LOSS", f"acknowledged version {ack.version} checksum {ack.checksum:#010x}, "
                                           f"sent version {version} checksum {checksum:#010x}")
                else:
                    self._on_progress(self.target, self.sent, max(self.total, self.sent), True, ack.checksum)
                    return WeightAck(self.target, ack.version, ack.checksum, ack.num_tensors, ack.num_bytes,
                                     ack.duration_s)
        assert self.failure is not None
        return self.failure

    def close(self) -> None:
        self._stop.set()
        if not self.call.done():
            self.call.cancel()
        self._channel.close()


class GrpcStreamTransport(WeightTransport):
    """Streams buckets to every target concurrently (see module docstring)."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_DEADLINE_S,
        token: str | None = None,
        on_progress: Progress | None = None,
        total_bytes: int = 0,
        max_queued_buckets: int = 2,
        tamper: Tamper | None = None,
    ) -> None:
        self.targets = checked_targets(targets)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.timeout_s = timeout_s
        self.token = token
        self.on_progress = on_progress or _no_progress
        self.total_bytes = total_bytes
        self.max_queued_buckets = max_queued_buckets
        self.tamper = tamper

    def buckets(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[
            tuple[rollout_pb2.WeightUpdateChunk, int]]:
        """Bucket chunks of about `bucket_bytes` and their payload sizes, in index order (a chunk's checksum is
        taken as it is encoded, or when its `bucket` is read)."""
        chunk, size, index = None, 0, 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > _MAX_TENSOR_BYTES:
                raise ValueError(f"tensor {name!r} has {nbytes} bytes, more than one gRPC message carries "
                                 f"({_MAX_TENSOR_BYTES}); use another transport for this model")
            if chunk is not None and size + nbytes > self.bucket_bytes:
                yield chunk, size
                chunk, size, index = None, 0, index + 1
            if chunk is None:
                chunk = PackedChunk(rollout_pb2.WeightUpdateChunk(), [])
                chunk.message.bucket.version, chunk.message.bucket.index = version, index
            _append(chunk, name, tensor)
            size += nbytes
        if chunk is not None:
            yield chunk, size

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, WeightAck | TargetFailure]:
        deadline = time.monotonic() + self.timeout_s
        streams: list[_TargetStream] = []
        try:
            for t in self.targets:
                streams.append(_TargetStream(t, token=self.token, timeout_s=self.timeout_s,
                                             max_queued=self.max_queued_buckets, total=self.total_bytes,
                                             on_progress=self.on_progress))
            checksums: list[int] = []
            for chunk, size in self.buckets(version, named_tensors):
                # Serialized here, once for every target (the streams pass the bytes through), and before the
                # next bucket is packed; the encoding takes the checksum. The tamper hook (tests) needs the message.
                item = chunk if self.tamper else serialize(chunk)
                checksums.append(chunk.bucket.checksum)
                self._offer(streams, item, size, deadline)
                if not any(s.alive() for s in streams):
                    break  # every target failed: stop packing (the caller drains its iterator)
            checksum = combine_checksums(checksums)
            if checksums:
                commit = rollout_pb2.WeightUpdateChunk(
                    commit=common_pb2.WeightCommit(version=version, num_buckets=len(checksums), checksum=checksum))
                self._offer(streams, commit, 0, deadline)
            for s in streams:
                s.offer(None, deadline)
            return {s.target: s.outcome(version, checksum, deadline) for s in streams}
        finally:
            for s in streams:
                s.close()

    def _offer(self, streams: list[_TargetStream], chunk: PackedChunk | rollout_pb2.WeightUpdateChunk | bytes,
               size: int, deadline: float) -> None:
        for s in streams:
            if s.alive():
                item = chunk
                if self.tamper and not isinstance(chunk, bytes):
                    item = self.tamper(s.target, chunk.materialize() if isinstance(chunk, PackedChunk) else chunk)
                s.offer((item, size), deadline)
