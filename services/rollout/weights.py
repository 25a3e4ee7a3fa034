"""Weight updates for a rollout replica: stage buckets, verify them, hand over one complete update.

`WeightStager` receives the buckets of one UpdateWeights stream. Each bucket is checked on arrival (its
CRC-32, its version against the one served, names known to the engine, shapes as the engine expects them,
finite values); the commit then checks that every bucket arrived and that the combined checksum matches.
Only a fully verified `StagedUpdate` ever reaches the engine, so a bad stream leaves the served weights
untouched. No gRPC and no vLLM here: errors carry the status-code name the servicer should answer with.

Names are the HF checkpoint names the engine's `load_weights` accepts (`model.layers.0.self_attn.q_proj
.weight`, ...), with full (unsharded) shapes; the engine fuses and shards them itself.
`read_checkpoint_specs` reads them from the model folder: they are what Rollout.Info lists.

The finiteness check sums each tensor once (a vectorised pass, a few ms per 64 MiB; NaN and inf survive a
sum) and only on a non-finite sum looks for the first bad element, so it costs little beside the copy
into the engine's dtype that staging makes anyway.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlfabric.v1 import common_pb2
from services.common.checksum import bucket_checksum, combine_checksums
from services.common.status import echo
from services.common.tensors import TensorDecodeError, to_torch


class WeightUpdateError(Exception):
    """A rejected update; `code` is the gRPC status name to answer with (nothing was applied)."""

    code = "INVALID_ARGUMENT"


class WeightDataLossError(WeightUpdateError):
    """Bytes were corrupted or a bucket is missing."""

    code = "DATA_LOSS"


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


class WeightStager:
    """Collects the buckets of one update stream and verifies them (see module docstring)."""

    def __init__(self, expected: Mapping[str, ParamSpec], held_version: int = 0) -> None:
        self._expected = expected
        self._held_version = held_version
        self._buckets: dict[int, tuple[int, list[tuple[str, torch.Tensor]]]] = {}
        self._names: dict[str, int] = {}
        self._version: int | None = None
        self._num_bytes = 0
        self.started_at = time.monotonic()

    def add_bucket(self, bucket: common_pb2.WeightBucket) -> None:
        """Verifies and stages one bucket; raises WeightUpdateError / WeightDataLossError."""
        if self._version is None:
            if bucket.version < self._held_version:
                raise WeightsVersionBehindError(bucket.version, self._held_version)
            self._version = bucket.version
        elif bucket.version != self._version:
            raise WeightUpdateError(
                f"bucket {bucket.index} is for version {bucket.version}, but this stream carries version "
                f"{self._version}: send one version per UpdateWeights call"
            )
        actual = bucket_checksum(bucket.tensors)
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
        for named in bucket.tensors:
            staged.append((named.name, self._decode(bucket.index, named)))
        for name, tensor in staged:
            self._names[name] = bucket.index
            self._num_bytes += tensor.numel() * tensor.element_size()
        self._buckets[bucket.index] = (actual, staged)

    def _decode(self, index: int, named: common_pb2.NamedTensor) -> torch.Tensor:
        spec = self._expected.get(named.name)
        if spec is None:
            close = [n for n in self._expected if n.rsplit(".", 2)[-2:] == named.name.rsplit(".", 2)[-2:]][:3]
            raise WeightUpdateError(
                f"bucket {index}: unknown parameter {echo(named.name)}; the engine accepts HF checkpoint names "
                "(Rollout.Info lists them)" + (f" such as {close}" if close else "")
            )
        if named.name in self._names:
            raise WeightUpdateError(
                f"bucket {index}: parameter {named.name!r} already arrived in bucket {self._names[named.name]}"
            )
        try:
            tensor = to_torch(named.tensor)
        except TensorDecodeError as e:
            raise WeightUpdateError(f"bucket {index}: parameter {named.name!r}: {e}") from e
        if tuple(tensor.shape) != spec.shape:
            raise WeightUpdateError(
                f"bucket {index}: parameter {named.name!r} has shape {echo(tuple(tensor.shape))}, the engine "
                f"expects {spec.shape} (full, unsharded HF layout)"
            )
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"bucket {index}: parameter {named.name!r} has non-float dtype {tensor.dtype}")
        # One copy into the engine's dtype now, so the apply is a plain copy into the parameters.
        staged = tensor.to(spec.dtype, copy=True)
        _require_finite(staged, f"bucket {index}: parameter {named.name!r}")
        return staged

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
        return StagedUpdate(commit.version, tensors, combined, self._num_bytes, self.started_at)


def make_bucket(version: int, index: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.WeightBucket:
    """Builds a checksummed bucket from named tensors (the sender's side; used by tests and benches)."""
    from services.common.tensors import to_proto

    named = [common_pb2.NamedTensor(name=n, tensor=to_proto(t)) for n, t in tensors.items()]
    return common_pb2.WeightBucket(version=version, index=index, tensors=named, checksum=bucket_checksum(named))


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
