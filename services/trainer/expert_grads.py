"""Expert-parallel gradients for the trainer's optimizer: which weights are experts, and their groups.

With expert parallelism (EP > 1) megatron-core tags each rank's local experts `allreduce=False`, and Megatron's
DDP keeps them in buffers of their own: an expert's gradient already holds the tokens that every data-parallel
rank of its EP group dispatched to it, so it is summed over the expert-data-parallel group (the ranks that hold
the same experts: world / (expert-TP x EP x PP)) and divided by the data-parallel size, where the other weights
are averaged over the data-parallel group. The distributed optimizer shards the expert buffers over the
expert-data-parallel group for the same reason.

The gradient norm counts every expert once (Megatron's ChainedOptimizer of a dense and an expert optimizer):
the non-expert weights' sum of squares over the model-parallel group (TP duplicates once), the experts' over the
expert-TP x EP x PP group (expert-TP duplicates once); sharded over data-parallel ranks, each rank's own part,
summed over every rank. TrainerOptimizer (optimizer.py) holds both kinds; this module names the groups.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from services.trainer import megatron_compat


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """The ranks that hold the same copy of a set of weights: their gradients are reduced (and, with the
    distributed optimizer, sharded) over `group`, whose size is `size` and where this rank is `rank`."""

    group: object
    size: int
    rank: int


def is_expert(param: torch.nn.Parameter) -> bool:
    """An expert-parallel weight (megatron-core's tag; only set when EP > 1)."""
    return not getattr(param, "allreduce", True)


def dense_group() -> ShardGroup:
    from megatron.core import parallel_state as ps

    return ShardGroup(ps.get_data_parallel_group(), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())


def expert_group() -> ShardGroup:
    from megatron.core import parallel_state as ps

    return ShardGroup(ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size(),
                      ps.get_expert_data_parallel_rank())


def expert_parallel(model) -> bool:
    """Whether `model` has expert-parallel weights anywhere in the group (the same answer on every rank, also on a
    pipeline stage without MoE layers, which still joins the experts' collectives)."""
    from megatron.core import parallel_state as ps

    from services.trainer import moe

    return moe.is_moe(model) and ps.get_expert_model_parallel_world_size() > 1


def counts_for_norm(param: torch.nn.Parameter) -> bool:
    """Whether this rank's copy of `param` enters the gradient norm (not a TP, or expert-TP, duplicate; not the
    second copy of a tied embedding)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    tp_group = ps.get_expert_tensor_parallel_group() if is_expert(param) else None
    return param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param, tp_group)


def grad_norm(dense: list[torch.Tensor], experts: list[torch.Tensor], *, distributed: bool, with_experts: bool) -> float:
    """The L2 norm of the whole model's gradient (module docstring); a collective of the trainer group.

    `dense` / `experts`: this rank's gradients that count (`counts_for_norm`); `distributed`: the data-parallel
    ranks hold disjoint parts; `with_experts`: `expert_parallel(model)`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    with megatron_compat.cpu_device_mode():
        if distributed or not with_experts:
            # Sharded, every rank holds a disjoint part of both kinds: one sum over the whole group.
            group = dist.group.WORLD if distributed else ps.get_model_parallel_group()
            return float(get_grad_norm_fp32(dense + experts, grad_stats_parallel_group=group))
        d = float(get_grad_norm_fp32(dense, grad_stats_parallel_group=ps.get_model_parallel_group()))
        e = float(get_grad_norm_fp32(experts, grad_stats_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group()))
    return math.sqrt(d * d + e * e)
