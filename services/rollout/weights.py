"""Weight updates for a rollout replica: stage buckets, verify them, hand over one complete update.

`WeightStager` receives the buckets of one UpdateWeights stream. Each bucket is checked on arrival (its
checksum, its version against the one served, names known to the engine, shapes as the engine expects them,
finite values); the commit then checks that every bucket arrived and that the combined checksum matches.
Only a fully verified `StagedUpdate` ever reaches the engine, so a bad stream leaves the served weights
untouched; except that the servicer applies shared-memory buckets one by one as they pass their checks
(`take`), so the replica's copy overlaps the trainer's writes, and a stream that fails midway leaves the engine
refusing to generate until a complete update lands. No gRPC and no vLLM here: errors carry the status-code
name the servicer should answer with.

Staged tensors are views, not copies: over the message bytes (gRPC transport) or over the shared-memory
segment the bucket names (shm transport, services/common/transports/shm.py), so the engine's
`load_weights` at the commit is the one copy into the parameters; only a dtype other than the engine's is
cast on arrival. The checksum and the finiteness check are one vectorised sum each (a float sum: NaN and inf
survive it; a non-finite sum sends to the exact check), each several times faster than the copy.

Names are the HF checkpoint names the engine's `load_weights` accepts (`model.layers.0.self_attn.q_proj
.weight`, ...), with full (unsharded) shapes; the engine fuses and shards them itself.
`read_checkpoint_specs` reads them from the model folder: they are what Rollout.Info lists.
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
from services.common.checksum import bucket_checksum, chain, combine_checksums, fold, word_sum
from services.common.status import echo
from services.common.tensors import TensorDecodeError, dtype_name, itemsize
from services.common.transports.collective import CollectiveError, CollectiveReceiver
from services.common.transports.shm import SegmentCache, SegmentOpenError

# The mapping of the latest shared-memory segment this process read (services/common/transports/shm.py).
SEGMENTS = SegmentCache()
# The collective group this process is a member of (services/common/transports/collective.py).
COLLECTIVE = CollectiveReceiver()


class WeightUpdateError(Exception):
    """A rejected update; `code` is the gRPC status name to answer with (nothing was applied)."""

    code = "INVALID_ARGUMENT"


class WeightDataLossError(WeightUpdateError):
    """Bytes were corrupted or a bucket is missing."""

    code = "DATA_LOSS"


class WeightSegmentError(WeightUpdateError):
    """A shared-memory bucket whose segment this replica cannot map (another host, or /dev/shm not shared)."""

    code = "FAILED_PRECONDITION"


class WeightCollectiveError(WeightUpdateError):
    """A collective bucket whose bytes did not arrive (the group failed); `code` as the group reported it."""

    def __init__(self, e: CollectiveError) -> None:
        super().__init__(str(e))
        self.code = e.code


class WeightsVersionBehindError(WeightUpdateError):
    """The update is for a version below the one served: versions only move forward."""

    code = "FAILED_PRECONDITION"

    def __init__(self, version: int, held: int) -> None:
        super().__init__(f"version {version} is below the version this replica serves ({held}): weights versions "
                         "only move forward; push a newer version")


@dataclass(frozen=True)
class ParamSpec:
    """What the engine expects for one HF-named tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StagedUpdate:
    """A verified update, ready to apply in one go."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]
    checksum: int
    num_bytes: int
    started_at: float = field(default_factory=time.monotonic)
    num_tensors: int = 0  # all tensors of the update, including those a streamed apply took before the commit


class WeightStager:
    """Collects the buckets of one update stream and verifies them (see module docstring)."""

    def __init__(self, expected: Mapping[str, ParamSpec], held_version: int = 0,
                 segments: SegmentCache | None = None) -> None:
        self._expected = expected
        self._segments = segments or SEGMENTS
        self._held_version = held_version
        self._buckets: dict[int, tuple[int, list[tuple[str, torch.Tensor]]]] = {}
        self._names: dict[str, int] = {}
        self._version: int | None = None
        self._num_bytes = 0
        self.started_at = time.monotonic()

    def add_bucket(self, bucket: common_pb2.WeightBucket, data: Sequence[Any] | None = None) -> None:
        """Verifies and stages one bucket; raises WeightUpdateError / WeightDataLossError.

        `data`: the tensors' bytes when the receiver kept them out of the message (wire.ReceivedChunk)."""
        if self._version is None:
            if bucket.version < self._held_version:
                raise WeightsVersionBehindError(bucket.version, self._held_version)
            self._version = bucket.version
        elif bucket.version != self._version:
            raise WeightUpdateError(
                f"bucket {bucket.index} is for version {bucket.version}, but this stream carries version "
                f"{self._version}: send one version per UpdateWeights call"
            )
        views = self._views(bucket, data)
        # One pass per tensor yields both the checksum and finiteness; a checksum mismatch wins over a bad value.
        checks = [_checksum_and_finite(t) for _, t in views]
        actual = chain(c for c, _ in checks)
        if actual != bucket.checksum:
            raise WeightDataLossError(
                f"bucket {bucket.index} of version {bucket.version}: checksum {actual:#010x} != sent "
                f"{bucket.checksum:#010x}; resend the update"
            )
        if bucket.index in self._buckets:
            if self._buckets[bucket.index][0] == actual:
                return  # a retried bucket with identical bytes: idempotent
            raise WeightUpdateError(f"bucket {bucket.index} was sent twice with different contents")
        staged = []
        for (name, tensor), (_, finite) in zip(views, checks, strict=True):
            where = f"bucket {bucket.index}: parameter {name!r}"
            if not finite:
                _require_finite(tensor, where)
            spec = self._expected[name]
            if tensor.dtype != spec.dtype:  # the only copy before the engine's own: a cast
                tensor = tensor.to(spec.dtype)
                _require_finite(tensor, where)
            staged.append((name, tensor))
        for name, tensor in staged:
            self._names[name] = bucket.index
            self._num_bytes += tensor.numel() * tensor.element_size()
        self._buckets[bucket.index] = (actual, staged)

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
        combined = combine_checksums([self._buckets[i][0] for i in range(commit.num_buckets)])
        if combined != commit.checksum:
            raise WeightDataLossError(
                f"version {commit.version}: combined checksum {combined:#010x} != commit's {commit.checksum:#010x}"
            )
        tensors = [item for i in range(commit.num_buckets) for item in self._buckets[i][1]]
        return StagedUpdate(commit.version, tensors, combined, self._num_bytes, self.started_at, len(self._names))

    def take(self, index: int) -> StagedUpdate:
        """The verified tensors of bucket `index`, handed over for a streamed apply (the bucket keeps only its
        checksum, for the commit's check)."""
        checksum, tensors = self._buckets[index]
        self._buckets[index] = (checksum, [])
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        assert self._version is not None
        return StagedUpdate(self._version, tensors, checksum, num_bytes, self.started_at, len(tensors))


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


def _checksum_and_finite(tensor: torch.Tensor) -> tuple[int, bool]:
    """The tensor's checksum (services/common/checksum.py) and whether every value may be finite: one
    vectorised int64 sum and one float sum, each several times faster than the copy the update makes. A float
    sum that is not finite (NaN, inf, or finite values whose sum overflowed) sends the caller to the exact check."""
    flat = tensor.reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    return fold(word_sum(raw), raw.nbytes), math.isfinite(float(flat.sum(dtype=acc)))


def _require_finite(tensor: torch.Tensor, where: str) -> None:
    """Refuses NaN / inf values (see module docstring for why a sum)."""
    if math.isfinite(float(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32))):
        return
    bad = (~torch.isfinite(tensor)).reshape(-1).nonzero()
    if len(bad) == 0:
        return  # finite values whose float32 sum overflowed
    first = int(bad[0])
    raise WeightUpdateError(f"{where} has {len(bad)} non-finite values (the first, {tensor.reshape(-1)[first].item()}, "
                            f"at flat index {first}); nothing was applied")


def read_checkpoint_specs(model_dir: str, dtype: Any) -> dict[str, ParamSpec]:
    """Names and full shapes of the tensors in the model folder's safetensors files (the update names)."""
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
