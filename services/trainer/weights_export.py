"""This rank's weight shards with Megatron names and partition metadata, for Trainer.Info and the weight sync.

`iter_shards(model, spec)` yields `WeightShard(meta, tensor)` for every parameter this rank holds: the
Megatron name with the MODEL-WIDE layer number (stages renumber layers from 0 locally, each stage holding the
layers its built model says, even or not; the renaming rule lives in services/common/weight_layout.py), the
shard's shape, its TP/PP/EP position and the dimension split
across TP ranks (-1 when replicated). How the fused tensors are laid out is weight_layout.py's knowledge,
not repeated here. The tensors are the live parameters (detached views, no copy).

Mixture-of-experts models: every parameter carries the rank's expert-parallel position. Megatron names a
local expert by its number on this EP rank (`mlp.experts.local_experts.i`, the model-wide expert being
`ep_rank * E/EP + i`), which is the naming weight_layout expects; the other parameters (the router included)
are the same on every EP rank and reported with its ep_rank too, as the mirrors weight_layout lists.
Expert-tensor parallelism other than the TP size has no layout there and is refused (`check_expert_layout`).

LoRA: the rollout serves the merged weights W + (alpha / r) B A under the base names (`lora.merged_parameters`,
one new tensor per adapted weight, made as the export reaches it); the adapters themselves are never exported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from services.common.model_spec import ModelSpec
from services.common.weight_layout import global_layer_name, stage_layer_counts
from services.trainer import lora
from services.trainer.model import canonical_name, config_stage_layers, unwrap


@dataclasses.dataclass(frozen=True)
class ShardMeta:
    name: str  # Megatron name, model-wide layer numbering
    shape: tuple[int, ...]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    partition_dim: int  # -1 when replicated over TP
    ep_rank: int = 0  # expert-parallel rank (0 without expert parallelism)
    ep_size: int = 1


@dataclasses.dataclass(frozen=True)
class WeightShard:
    meta: ShardMeta
    tensor: torch.Tensor


def check_expert_layout() -> None:
    """Refuse an expert-TP size other than the TP size: weight_layout splits experts over TP like dense MLPs."""
    from megatron.core import parallel_state as ps

    tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ps.get_expert_model_parallel_world_size() > 1 and etp != tp:
        raise ValueError(f"expert tensor parallel size {etp} differs from tensor_model_parallel_size {tp}: weight "
                         "sync and checkpoints lay experts out over TP (moe_tp_extend_ep is not supported there)")


def exported_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """What the rollout serves of this rank's model: every parameter (in `named_parameters` order; a LoRA model's
    adapted weights merged, its adapters left out), then the routers' expert bias (DeepSeek-V3's
    `e_score_correction_bias`: a buffer, trained outside the gradient, read when routing)."""
    yield from lora.merged_parameters(model)
    for name, buffer in model.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buffer


def iter_shards(model, spec: ModelSpec) -> Iterator[WeightShard]:
    """Every exported tensor of this rank (`exported_tensors`)."""
    from megatron.core import parallel_state as ps

    check_expert_layout()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    stages = stage_layer_counts(spec, pp, config_stage_layers(unwrap(model).config))
    for name, p in exported_tensors(model):
        partition_dim = int(getattr(p, "partition_dim", -1)) if getattr(p, "tensor_model_parallel", False) else -1
        meta = ShardMeta(global_layer_name(canonical_name(name), pp_rank, stages), tuple(p.shape),
                         tp_rank, tp, pp_rank, pp, partition_dim, ep_rank, ep)
        yield WeightShard(meta, p.detach())
