"""The resharding plan as it travels: `ReshardPlan`, its proto form (`trainer_pb2.ReshardPlan`), its error type.

The coordinator builds plans (`services/coordinator/resharding.py`, `plan_resharding`); the trainer executes
them (`services/trainer/weight_sync.py`). Both only share this data type and the layout rules of
`services/common/weight_layout.py` (applied by `services/common/tensor_recipes.py`), so neither service imports
the other.

`from_proto` checks everything a rank relies on before any byte moves (sizes, ranks in the layout, slices
inside their shards, pieces that add up to the tensor), so a malformed plan is the caller's
INVALID_ARGUMENT, never a rank blocked in a send.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rlfabric.v1 import common_pb2, trainer_pb2
from services.common.status import echo
from services.common.tensor_recipes import ShardSlice, TensorRecipe
from services.common.tensors import dtype_code, dtype_name

_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class ReshardError(ValueError):
    """The trainer and rollout layouts do not fit the model, or a plan is malformed (the message says where)."""


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The tensors to send, in order, each with the shard slices composing it."""

    trainer_tp: int
    trainer_pp: int
    tensors: tuple[TensorRecipe, ...]
    dtype: str = ""  # dtype to send ("float32", "bfloat16", ...); "" keeps the trainer's
    trainer_ep: int = 1  # expert-parallel size (MoE); the slices' ep_rank is below it
    # HF name -> dtype to send that tensor in, where the replica keeps it in another dtype than `dtype` (vLLM's
    # float32 e_score_correction_bias in a bf16 engine); a tensor not named here goes in `dtype`.
    tensor_dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def shards_of(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> list[str]:
        """Stage-local names of the shards this rank must contribute (first use order, no repeats)."""
        names = {s.name: None for r in self.tensors for s in r.sources if s.key == (tp_rank, pp_rank, ep_rank)}
        return list(names)

    def dtype_of(self, hf_name: str) -> str:
        """The dtype tensor `hf_name` is sent in ("" keeps the trainer's)."""
        return self.tensor_dtypes.get(hf_name, self.dtype)

    def to_proto(self) -> trainer_pb2.ReshardPlan:
        return trainer_pb2.ReshardPlan(
            trainer_tensor_parallel_size=self.trainer_tp,
            trainer_pipeline_parallel_size=self.trainer_pp,
            dtype=dtype_code(self.dtype) if self.dtype else common_pb2.DTYPE_UNSPECIFIED,
            tensors=[_tensor_to_proto(r, self.tensor_dtypes.get(r.hf_name, "")) for r in self.tensors],
            trainer_expert_parallel_size=self.trainer_ep,
        )

    @classmethod
    def from_proto(cls, msg: trainer_pb2.ReshardPlan) -> ReshardPlan:
        """The plan, checked (see module docstring); raises ReshardError naming the first problem."""
        tp, pp = msg.trainer_tensor_parallel_size, msg.trainer_pipeline_parallel_size
        ep = msg.trainer_expert_parallel_size or 1  # unset: a plan without expert parallelism
        if tp < 1 or pp < 1:
            raise ReshardError(f"plan: trainer sizes must be >= 1, got TP={tp} PP={pp}; build plans with "
                               "plan_resharding (services/coordinator/resharding.py)")
        if not msg.tensors:
            raise ReshardError("plan: no tensors")
        dtype = _float_dtype(msg.dtype, "plan")
        tensors = tuple(_tensor_from_proto(t, tp, pp, ep) for t in msg.tensors)
        tensor_dtypes = {t.name: _float_dtype(t.dtype, f"plan tensor {echo(t.name)}")
                         for t in msg.tensors if t.dtype != common_pb2.DTYPE_UNSPECIFIED}
        return cls(tp, pp, tensors, dtype, ep, tensor_dtypes)


def _float_dtype(code: int, where: str) -> str:
    """The float dtype name of a `DType` ("" for DTYPE_UNSPECIFIED); ReshardError for any other type."""
    if code == common_pb2.DTYPE_UNSPECIFIED:
        return ""
    dtype = dtype_name(code) if code in common_pb2.DType.values() else ""
    if dtype not in _FLOAT_DTYPES:
        raise ReshardError(f"{where}: dtype {code} is not a float type ({', '.join(_FLOAT_DTYPES)})")
    return dtype


def _tensor_to_proto(r: TensorRecipe, dtype: str) -> trainer_pb2.PlannedTensor:
    return trainer_pb2.PlannedTensor(
        name=r.hf_name, shape=r.hf_shape, concat_dim=r.concat_dim,
        dtype=dtype_code(dtype) if dtype else common_pb2.DTYPE_UNSPECIFIED,
        sources=[trainer_pb2.ShardSlice(name=s.name, tp_rank=s.tp_rank, pp_rank=s.pp_rank, ep_rank=s.ep_rank,
                                        shard_shape=s.shard_shape, groups=s.groups, start=s.start, stop=s.stop)
                 for s in r.sources],
    )


def _tensor_from_proto(t: trainer_pb2.PlannedTensor, tp: int, pp: int, ep: int) -> TensorRecipe:
    where = f"plan tensor {echo(t.name)}"
    shape = tuple(int(n) for n in t.shape)
    if not shape or any(n < 1 for n in shape):
        raise ReshardError(f"{where}: shape {echo(shape)} must have positive dimensions")
    if t.concat_dim >= len(shape):
        raise ReshardError(f"{where}: concat_dim {t.concat_dim} is not a dimension of shape {shape}")
    if not t.sources:
        raise ReshardError(f"{where}: no sources")
    sources = tuple(_slice_from_proto(s, where, tp, pp, ep) for s in t.sources)
    for s in sources:
        if len(s.shape) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(s.shape, shape, strict=True))
                                             if i != t.concat_dim):
            raise ReshardError(f"{where}: the piece of {echo(s.name)} has shape {s.shape}, which does not fit "
                               f"shape {shape} along concat_dim {t.concat_dim}")
    if sum(s.shape[t.concat_dim] for s in sources) != shape[t.concat_dim]:
        raise ReshardError(f"{where}: the pieces add up to {sum(s.shape[t.concat_dim] for s in sources)} along "
                           f"concat_dim {t.concat_dim}, the shape has {shape[t.concat_dim]}")
    return TensorRecipe(t.name, shape, sources, int(t.concat_dim))


def _slice_from_proto(s: trainer_pb2.ShardSlice, where: str, tp: int, pp: int, ep: int) -> ShardSlice:
    here = f"{where}, source {echo(s.name)}"
    if s.tp_rank >= tp or s.pp_rank >= pp or s.ep_rank >= ep:
        raise ReshardError(f"{here}: tp_rank {s.tp_rank}, pp_rank {s.pp_rank}, ep_rank {s.ep_rank} is outside "
                           f"TP={tp} PP={pp} EP={ep}")
    shard_shape = tuple(int(n) for n in s.shard_shape)
    if not shard_shape or any(n < 1 for n in shard_shape):
        raise ReshardError(f"{here}: shard_shape {echo(shard_shape)} must have positive dimensions")
    if s.groups < 1 or shard_shape[0] % s.groups:
        raise ReshardError(f"{here}: groups {s.groups} must be >= 1 and divide shard_shape[0] {shard_shape[0]}")
    block = shard_shape[0] // s.groups
    stop = s.stop if s.HasField("stop") else None
    if not s.start < (block if stop is None else stop) <= block:
        raise ReshardError(f"{here}: rows [{s.start}, {stop}) must be non-empty and inside a block of {block}")
    return ShardSlice(s.name, int(s.tp_rank), int(s.pp_rank), shard_shape, int(s.groups), int(s.start),
                      None if stop is None else int(stop), int(s.ep_rank))
