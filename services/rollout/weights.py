"""Weight updates for a rollout replica: stage buckets, verify them, hand them to the engine.

`WeightStager` receives the buckets of one UpdateWeights stream. Each bucket is checked (its checksum, its
version against the one served, names known to the engine, shapes as the engine expects them, finite
values); the commit then checks that every bucket arrived and passed, and that the combined checksum
matches. Buckets whose bytes stay out of the message (gRPC views, shared memory) are handed to the engine
one by one as they arrive (`take`), so the replica's copy overlaps the transfer, and the engine checks their
bytes as it copies them (weight_checks.py); the version moves only at a verified commit. A gRPC stream that fails
midway leaves the served weights bitwise as they were (the engine backs up what each bucket overwrites and
restores it: engine.py `restore_weights`); a shared-memory one leaves the engine refusing to generate until
a complete update lands. Buckets with their bytes inside the message (and collective buckets) are applied
together at the commit. No gRPC and no vLLM here: errors carry the status-code name the servicer should
answer with.

Staged tensors are views, not copies: over the message bytes (gRPC transport) or over the shared-memory
segment the bucket names (shm transport, services/common/transports/shm.py), so the engine's
copy into the parameters (the engine's, with the checks riding along, or vLLM's `load_weights`) is the one
copy (plus, over gRPC, the backup of the values it overwrites); only a dtype other than the engine's is
cast. Names, shapes and versions are refused as a bucket arrives, a bad checksum or value while the engine
applies the bucket.

Names are the HF checkpoint names the engine's `load_weights` accepts (`model.layers.0.self_attn.q_proj
.weight`, ...), with full (unsharded) shapes; the engine fuses and shards them itself.
`read_checkpoint_specs` reads them from the model folder (the engine then gives each the dtype of the vLLM
parameter it loads into, worker_ops.py `held_dtypes`): they are what Rollout.Info lists.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfabric.v1 import common_pb2
from services.common.checksum import bucket_checksum, combine_checksums
from services.common.status import echo
from services.common.tensors import TensorDecodeError, dtype_name, itemsize
from services.common.transports.collective import CollectiveReceiver
from services.common.transports.collective_group import CollectiveError
from services.common.transports.shm import SegmentCache, SegmentOpenError
from services.common.weight_version import moves_forward
from services.rollout.weight_checks import (
    ParamSpec,
    Verification,
    Verified,
    WeightDataLossError,
    WeightSegmentError,
    WeightsVersionBehindError,
    WeightUpdateError,
)

__all__ = ["COLLECTIVE", "SEGMENTS", "ParamSpec", "StagedUpdate", "WeightCollectiveError", "WeightDataLossError",
           "WeightSegmentError", "WeightStager", "WeightUpdateError", "WeightsVersionBehindError", "make_bucket",
           "read_checkpoint_specs"]

# The mapping of the latest shared-memory segment this process read (services/common/transports/shm.py).
SEGMENTS = SegmentCache()
# The collective group this process is a member of (services/common/transports/collective.py).
COLLECTIVE = CollectiveReceiver()


class WeightCollectiveError(WeightUpdateError):
    """A collective bucket whose bytes did not arrive (the group failed); `code` as the group reported it."""

    def __init__(self, e: CollectiveError) -> None:
        super().__init__(str(e))
        self.code = e.code


@dataclass
class StagedUpdate:
    """A verified update, ready to apply in one go."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] | Verified  # Verified: a taken bucket, checked as it is read
    checksum: int
    num_bytes: int
    started_at: float = field(default_factory=time.monotonic)
    num_tensors: int = 0  # all tensors of the update, including those a streamed apply took before the commit
    # The names of `tensors`, known before a taken bucket's bytes pass (what a backup must cover).
    names: list[str] = field(default_factory=list)


class WeightStager:
    """Collects the buckets of one update stream and verifies them (see module docstring)."""

    def __init__(self, expected: Mapping[str, ParamSpec], held_version: int = 0,
                 segments: SegmentCache | None = None) -> None:
        self._expected = expected
        self._segments = segments or SEGMENTS
        self._held_version = held_version
        self._buckets: dict[int, tuple[int, Verification]] = {}  # index -> (sent checksum, checks)
        self._names: dict[str, int] = {}
        self._version: int | None = None
        self._num_bytes = 0
        self.started_at = time.monotonic()

    def add_bucket(self, bucket: common_pb2.WeightBucket, data: Sequence[Any] | None = None) -> None:
        """Checks and stages one bucket; raises WeightUpdateError / WeightDataLossError.

        `data`: the tensors' bytes when the receiver kept them out of the message (wire.ReceivedChunk). The
        bytes of a streamed bucket (`data` given, or shared memory) are verified by whoever takes it (`take`:
        the engine, as it applies it); `commit` and every later `add_bucket` surface its failure. Other
        buckets (and retries) are verified here, before this returns."""
        if self._version is None:
            if not moves_forward(bucket.version, self._held_version):
                raise WeightsVersionBehindError(bucket.version, self._held_version)
            self._version = bucket.version
        elif bucket.version != self._version:
            raise WeightUpdateError(
                f"bucket {bucket.index} is for version {bucket.version}, but this stream carries version "
                f"{self._version}: send one version per UpdateWeights call"
            )
        self._raise_failed()
        views = self._views(bucket, data)
        pending = Verification(bucket.index, bucket.version, bucket.checksum, views, self._expected)
        if bucket.index in self._buckets:
            pending.run()
            pending.result()
            if self._buckets[bucket.index][0] == bucket.checksum:
                return  # a retried bucket with identical bytes: idempotent
            raise WeightUpdateError(f"bucket {bucket.index} was sent twice with different contents")
        if data is None and not bucket.HasField("shm"):  # bytes in the message, or a collective's (checked here)
            pending.run()
            pending.result()
        # A streamed bucket is checked by the engine as it copies each tensor in (`take`): one pass over the
        # bytes; `commit` checks what the engine did not reach.
        for name, tensor in views:
            self._names[name] = bucket.index
            self._num_bytes += tensor.numel() * self._expected[name].dtype.itemsize
        self._buckets[bucket.index] = (bucket.checksum, pending)

    def _raise_failed(self) -> None:
        """Raises the failure of a bucket verified in the background, if one failed already."""
        for _, pending in self._buckets.values():
            if pending.failed():
                pending.result()

    def _views(self, bucket: common_pb2.WeightBucket, data: Sequence[Any] | None) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors as torch views over the message bytes or the shared-memory segment (no copy)."""
        segment = None
        if bucket.HasField("shm"):
            if len(bucket.shm.offsets) != len(bucket.tensors):
                raise WeightUpdateError(f"bucket {bucket.index}: {len(bucket.shm.offsets)} shm offsets for "
                                        f"{len(bucket.tensors)} tensors")
            try:
                segment = self._segments.array(bucket.shm)
            except SegmentOpenError as e:
                raise WeightSegmentError(f"bucket {bucket.index}: {e}") from e
        if bucket.HasField("collective"):  # the bytes arrive by broadcast, not in the message
            try:
                data = COLLECTIVE.receive(bucket)
            except CollectiveError as e:
                raise WeightCollectiveError(e) from e
        if data is not None and len(data) != len(bucket.tensors):
            raise WeightUpdateError(f"bucket {bucket.index}: {len(data)} data fields for {len(bucket.tensors)} tensors")
        views = []
        for i, named in enumerate(bucket.tensors):
            self._check_named(bucket.index, named)
            try:
                if segment is None:
                    tensor = _from_bytes(named.tensor, None if data is None else data[i])
                else:
                    tensor = _from_segment(segment, int(bucket.shm.offsets[i]), named.tensor)
            except TensorDecodeError as e:
                raise WeightUpdateError(f"bucket {bucket.index}: parameter {named.name!r}: {e}") from e
            spec = self._expected[named.name]
            if tuple(tensor.shape) != spec.shape:
                raise WeightUpdateError(
                    f"bucket {bucket.index}: parameter {named.name!r} has shape {echo(tuple(tensor.shape))}, "
                    f"the engine expects {spec.shape} (full, unsharded HF layout)"
                )
            if not tensor.is_floating_point():
                raise WeightUpdateError(f"bucket {bucket.index}: parameter {named.name!r} has non-float dtype "
                                        f"{tensor.dtype}")
            views.append((named.name, tensor))
        return views

    def _check_named(self, index: int, named: common_pb2.NamedTensor) -> None:
        if named.name not in self._expected:
            close = [n for n in self._expected if n.rsplit(".", 2)[-2:] == named.name.rsplit(".", 2)[-2:]][:3]
            raise WeightUpdateError(
                f"bucket {index}: unknown parameter {echo(named.name)}; the engine accepts HF checkpoint names "
                "(Rollout.Info lists them)" + (f" such as {close}" if close else "")
            )
        if self._names.get(named.name, index) != index:  # the same bucket again is a retry (add_bucket)
            raise WeightUpdateError(
                f"bucket {index}: parameter {named.name!r} already arrived in bucket {self._names[named.name]}"
            )

    def commit(self, commit: common_pb2.WeightCommit) -> StagedUpdate:
        """Checks completeness and the combined checksum; returns the update to apply."""
        if self._version is not None and commit.version != self._version:
            raise WeightUpdateError(f"commit is for version {commit.version}, the buckets for {self._version}")
        if commit.num_buckets == 0 or not self._buckets:
            raise WeightUpdateError("commit without buckets: send at least one WeightBucket before the commit")
        missing = sorted(set(range(commit.num_buckets)) - set(self._buckets))
        extra = sorted(set(self._buckets) - set(range(commit.num_buckets)))
        if missing:
            raise WeightDataLossError(f"version {commit.version}: buckets {missing} of {commit.num_buckets} never arrived")
        if extra:
            raise WeightUpdateError(f"buckets {extra} exceed the commit's num_buckets={commit.num_buckets}")
        # Every bucket's bytes must have matched its sent checksum (checks what the engine did not take), so
        # the sent checksums are the received ones.
        tensors = [item for i in range(commit.num_buckets) for item in self._buckets[i][1].result()]
        combined = combine_checksums([self._buckets[i][0] for i in range(commit.num_buckets)])
        if combined != commit.checksum:
            raise WeightDataLossError(
                f"version {commit.version}: combined checksum {combined:#010x} != commit's {commit.checksum:#010x}"
            )
        return StagedUpdate(commit.version, tensors, combined, self._num_bytes, self.started_at, len(self._names),
                            [name for name, _ in tensors])

    def take(self, index: int) -> StagedUpdate:
        """Bucket `index` (shared memory or gRPC views), handed over for a streamed apply that checks it as it
        goes (weight_checks.Verified): the bucket's failure is raised at its first bad tensor (or after the
        last one, for a checksum mismatch); `commit` re-raises it. The bucket keeps only its checksum and
        outcome."""
        checksum, pending = self._buckets[index]
        tensors = pending.take()
        num_bytes = sum(self._expected[name].dtype.itemsize * math.prod(shape) for name, shape in pending.shapes())
        assert self._version is not None
        return StagedUpdate(self._version, tensors, checksum, num_bytes, self.started_at, len(tensors),
                            [name for name, _ in pending.shapes()])


def make_bucket(version: int, index: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.WeightBucket:
    """Builds a checksummed bucket from named tensors (the sender's side; used by tests and benches)."""
    from services.common.tensors import to_proto

    named = [common_pb2.NamedTensor(name=n, tensor=to_proto(t)) for n, t in tensors.items()]
    return common_pb2.WeightBucket(version=version, index=index, tensors=named, checksum=bucket_checksum(named))


def _torch_dtype(t: common_pb2.Tensor) -> torch.dtype:
    try:
        return getattr(torch, dtype_name(t.dtype))
    except ValueError as e:
        raise TensorDecodeError(str(e)) from e


def _numel(t: common_pb2.Tensor) -> int:
    if any(d < 0 for d in t.shape):
        raise TensorDecodeError(f"shape {list(t.shape)} has a negative dimension")
    return math.prod(t.shape)


def _from_bytes(t: common_pb2.Tensor, data: Any = None) -> torch.Tensor:
    """A view over `data`, or over the message's bytes (read once: each access of a bytes field copies it)."""
    dtype, numel = _torch_dtype(t), _numel(t)
    data = t.data if data is None else data
    if len(data) != numel * itemsize(t.dtype):
        raise TensorDecodeError(f"{len(data)} bytes for shape {list(t.shape)} of {dtype} "
                                f"({numel * itemsize(t.dtype)} expected)")
    if numel == 0:
        return torch.empty(tuple(t.shape), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are immutable: nothing writes to these views
        return torch.frombuffer(data, dtype=dtype).reshape(tuple(t.shape))


def _from_segment(segment: np.ndarray, offset: int, t: common_pb2.Tensor) -> torch.Tensor:
    dtype, numel = _torch_dtype(t), _numel(t)
    nbytes = numel * itemsize(t.dtype)
    if t.data:
        raise TensorDecodeError("a shared-memory bucket carries the bytes in the segment, not in `data`")
    if offset % 64 or offset + nbytes > segment.nbytes:
        raise TensorDecodeError(f"offset {offset} (+{nbytes} bytes) is unaligned or beyond the segment's "
                                f"{segment.nbytes} bytes")
    raw = torch.from_numpy(segment[offset:offset + nbytes])
    return raw.view(dtype).reshape(tuple(t.shape)) if numel else torch.empty(tuple(t.shape), dtype=dtype)


def read_checkpoint_specs(model_dir: str, dtype: Any) -> dict[str, ParamSpec]:
    """Names and full shapes of the tensors in the model folder's safetensors files (the update names), all in
    `dtype` (the engine corrects those it keeps in another, worker_ops.py `held_dtypes`)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}: the rollout engine needs an HF folder")
    specs: dict[str, ParamSpec] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                specs[name] = ParamSpec(tuple(f.get_slice(name).get_shape()), dtype)
    return specs
