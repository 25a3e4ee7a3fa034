"""This rank's weight shards with Megatron names and partition metadata, for the weight sync.

`iter_shards(model, spec)` yields `WeightShard(meta, tensor)` for every parameter this rank holds:
the Megatron name with the GLOBAL layer number (stages renumber layers from 0 locally), the shard's
shape, TP/PP position, the dimension split across TP ranks (-1 when replicated) and the layout facts
a resharding plan needs (fused QKV per query group, fused [gate; up] per TP rank). The tensors are
the live parameters (detached views, no copy); the weight-sync transport serialises them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch

from services.common.model_spec import ModelSpec
from services.trainer.model import canonical_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ShardMeta:
    name: str  # Megatron name, global layer numbering
    shape: tuple[int, ...]
    dtype: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    partition_dim: int  # -1 when replicated over TP
    layout: str  # "plain", "qkv_grouped" (rows [q_g; k_g; v_g] per query group) or "gate_up"


@dataclasses.dataclass(frozen=True)
class WeightShard:
    meta: ShardMeta
    tensor: torch.Tensor


def global_name(local_name: str, pp_rank: int, layers_per_stage: int) -> str:
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{local_name[m.end():]}"


def iter_shards(model, spec: ModelSpec) -> Iterator[WeightShard]:
    """Every parameter of this rank, in `named_parameters` order."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    per_stage = spec.num_hidden_layers // pp
    for name, p in model.named_parameters():
        partition_dim = int(getattr(p, "partition_dim", -1)) if getattr(p, "tensor_model_parallel", False) else -1
        layout = "plain"
        if "linear_qkv" in name:
            layout = "qkv_grouped"
        elif "linear_fc1" in name:
            layout = "gate_up"
        meta = ShardMeta(
            name=global_name(canonical_name(name), pp_rank, per_stage),
            shape=tuple(p.shape),
            dtype=str(p.dtype).removeprefix("torch."),
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            pp_size=pp,
            partition_dim=partition_dim,
            layout=layout,
        )
        yield WeightShard(meta, p.detach())
