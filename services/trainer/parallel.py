"""torch.distributed start-up and Megatron parallel state for one trainer rank.

Owns: choosing the backend (gloo on CPU, nccl on CUDA, hccl on Ascend), initialising the default
process group from explicit rank/world/master arguments (or torchrun's environment), Megatron's
TP/PP/DP groups and, for mixture-of-experts models, its expert-parallel (EP) groups, and a `Layout`
record of where this rank sits. Nothing here knows about models.

Expert parallelism as Megatron lays it out: EP ranks share one copy of the experts, each expert split over
the expert-TP ranks (TP unless given: Megatron's default; 1 under MindSpeed's moe_tp_extend_ep, where EP
is then EP x TP, as services/common/config/derived.py derives), and expert-TP x EP x PP must divide the
world. The expert-data-parallel ranks (world / (expert-TP x EP x PP)) hold the same experts: the experts'
gradients are summed over them and divided by the data-parallel size (Megatron's DDP), not averaged over
the whole data-parallel group as the other weights are.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from services.common.net import free_port
from services.trainer import megatron_compat

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this rank sits in the trainer group."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1  # megatron-core's expert parallel size
    ep_rank: int = 0
    etp: int = 1  # expert tensor parallel size


def default_backend() -> str:
    """nccl on CUDA, hccl on Ascend, gloo on CPU."""
    if torch.cuda.is_available():
        return "nccl"
    if megatron_compat.accelerator_present():
        return "hccl"
    return "gloo"


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: Any = None,
) -> None:
    """Initialise the default process group (arguments override torchrun's RANK/WORLD_SIZE/MASTER_*).

    `store`: rank 0's TCPStore, made on a socket bound to one interface (services/trainer/launch.py); a store
    that `init_process_group` creates itself listens on every interface.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = master_port or int(os.environ.get("MASTER_PORT", 0)) or None
    if master_port is None:
        if world_size > 1:
            raise ValueError("master_port (or MASTER_PORT) is required when world_size > 1")
        master_port = free_port()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
    megatron_compat.apply_cpu_patches()
    dist.init_process_group(
        backend=backend,
        **({"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{master_port}"}),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    logger.info("rank %d/%d joined (%s)", rank, world_size, backend)


def init_model_parallel(tp: int, pp: int, *, seed: int = 1, ep: int = 1, etp: int | None = None) -> Layout:
    """Megatron's parallel groups (TP innermost, then DP, then PP; experts: expert-TP, EP) and the RNG tracker.

    `ep` / `etp`: megatron-core's expert parallel and expert tensor parallel sizes (etp None: TP).
    """
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size*pipeline_model_parallel_size={tp * pp}")
    expert_tp = tp if etp is None else etp
    if ep < 1 or expert_tp < 1 or world % (expert_tp * ep * pp):
        raise ValueError(f"expert parallel size {ep} x expert tensor parallel size {expert_tp} x "
                         f"pipeline_model_parallel_size {pp} must divide the world size {world} "
                         f"(expert_model_parallel_size must divide the data-parallel size)")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tp,
            create_gloo_process_groups=dist.get_backend() != "gloo",
        )
    megatron_compat.seed_model_parallel_rng(seed)
    return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )


def shutdown() -> None:
    """Destroy Megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
