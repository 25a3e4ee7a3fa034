"""Where the actor's optimizer (optimizer.py) keeps each trainable parameter, and what its Adam steps.

- **Weight-decay groups** (`param_groups`): Megatron's defaults, decay on matrices only.
- **The main-gradient buffer** (`plan_buffer`): one contiguous buffer in forward parameter order (Megatron DDP's
  layout), each trainable parameter a `Slot` in one `Bucket`; expert-parallel weights come last, in buckets of
  their own. Unsharded: one bucket, no padding. Sharded (`use_distributed_optimizer`): buckets of at least
  max(40M, 1M x DP) elements (the size Megatron's DDP uses when it overlaps the reduction), so the all-gather
  after a step needs one bucket of scratch memory, not the model's; each parameter starts at a multiple of 64
  elements and each bucket ends at a multiple of lcm(group size, 128), as Megatron aligns them, and rank r of
  the bucket's group owns its r-th equal part (`shard`).
- **Pieces** (`Piece`): the part of one parameter this rank's Adam steps, and the tensor it steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from services.trainer import expert_grads
from services.trainer.reuse_fp32_param import join_master

_PARAM_ALIGN = 64
_BUCKET_ALIGN = 128


def param_groups(model) -> list[dict[str, Any]]:
    """Megatron's default groups: weight decay on matrices, none on biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [
        {"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0},
    ]


@dataclasses.dataclass
class Bucket:
    start: int  # [start, end) in the gradient buffer; (end - start) is a multiple of its group's size when sharded
    end: int
    expert: bool = False  # holds expert-parallel weights: reduced and sharded over the expert-data-parallel group


@dataclasses.dataclass
class Slot:
    """Where one trainable parameter sits in the gradient buffer."""

    name: str  # canonical Megatron name
    param: torch.nn.Parameter
    offset: int
    bucket: int


@dataclasses.dataclass
class Piece:
    """The part [lo, hi) of one parameter's flattened elements that this rank's Adam steps (all of it unsharded).

    `main` is the tensor Adam steps: an fp32 master copy (`own_master`; with reuse_fp32_param rebuilt from the
    parameter and `residual` only during a step), the model parameter itself (plain optimizer, no master), or,
    sharded without master, a tensor bound to the parameter's elements only during a step (a lasting view would
    keep an offloaded parameter's storage alive).
    """

    slot: Slot
    lo: int
    hi: int
    main: torch.Tensor
    own_master: bool
    residual: torch.Tensor | None = None  # reuse_fp32_param: int16 rest of the master below the bf16 parameter

    @property
    def buf_lo(self) -> int:
        return self.slot.offset + self.lo

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def own_elements(self) -> torch.Tensor:
        """The model parameter's elements [lo, hi), flat (a view)."""
        return self.slot.param.detach().view(-1)[self.lo : self.hi]

    def master_value(self) -> torch.Tensor:
        """The fp32 master weights (rebuilt from parameter and residual with reuse_fp32_param)."""
        if self.residual is not None:
            return join_master(self.own_elements(), self.residual)
        return self.main if self.own_master else self.own_elements().float()

    def local_value(self) -> torch.Tensor:
        """The new weights as the model stores them, after this piece's Adam step."""
        if self.own_master and self.residual is None:
            return self.main.to(self.slot.param.dtype)
        return self.own_elements()  # stepped in place, or split into it


def plan_buffer(named: list[tuple[str, torch.nn.Parameter]], groups: dict[bool, Any], *,
                distributed: bool, dp: int) -> tuple[list[Slot], list[Bucket], int]:
    """Slots and buckets of the gradient buffer (module docstring), and its length in elements.

    `named`: (canonical name, parameter), experts last; `groups[expert]`: the group a bucket is sharded over.
    """
    bucket_size = max(40_000_000, 1_000_000 * dp) if distributed else None
    slots: list[Slot] = []
    buckets: list[Bucket] = []

    def close(start: int, end: int, expert: bool) -> int:
        if distributed:
            end = start + _round_up(end - start, math.lcm(groups[expert].size, _BUCKET_ALIGN))
        buckets.append(Bucket(start, end, expert))
        return end

    offset = start = 0
    expert = False
    for name, p in named:
        if expert_grads.is_expert(p) != expert:  # the experts start a bucket of their own
            if start < offset:
                start = offset = close(start, offset, expert)
            expert = True
        if distributed:
            offset = _round_up(offset, _PARAM_ALIGN)
        slots.append(Slot(name, p, offset, len(buckets)))
        offset += p.numel()
        if bucket_size is not None and offset - start >= bucket_size:
            start = offset = close(start, offset, expert)
    if not buckets or start < offset:
        start = offset = close(start, offset, expert)
    return slots, buckets, offset


def shard(bucket: Bucket, group: Any, rank: int | None = None) -> tuple[int, int]:
    """[lo, hi) of `bucket` in the buffer that `rank` (default: this one) of `group` owns."""
    rank = group.rank if rank is None else rank
    size = (bucket.end - bucket.start) // group.size
    return bucket.start + rank * size, bucket.start + (rank + 1) * size


def make_piece(slot: Slot, owned: tuple[int, int] | None, *, mixed: bool, reuse: bool) -> Piece | None:
    """The piece of `slot` this rank steps: the part inside `owned` (its shard of the buffer; None unsharded),
    None when that is empty. `mixed`: low-precision parameters get fp32 masters (`reuse`: as residuals)."""
    n, p = slot.param.numel(), slot.param
    if owned is not None:
        lo, hi = max(owned[0], slot.offset) - slot.offset, min(owned[1], slot.offset + n) - slot.offset
        if hi <= lo:
            return None
    else:
        lo, hi = 0, n
    if mixed and p.dtype != torch.float32:
        if reuse:  # the master is the parameter exactly: a zero residual
            empty = torch.empty(0, dtype=torch.float32, device=p.device)
            return Piece(slot, lo, hi, empty, True, torch.zeros(hi - lo, dtype=torch.int16, device=p.device))
        main = p.detach().reshape(-1)[lo:hi].to(torch.float32, copy=True)
        return Piece(slot, lo, hi, main, True)
    if owned is None:
        return Piece(slot, lo, hi, p, False)
    return Piece(slot, lo, hi, torch.empty(0, dtype=p.dtype, device=p.device), False)


def accumulate_main_grad(param: torch.nn.Parameter) -> None:
    # Megatron's DDP hook: each backward's grad goes into the (fp32) main grad, and `.grad` is freed at once.
    if param.main_grad is None:
        raise RuntimeError("the gradient buffer is offloaded; onload grads before a backward pass")
    param.main_grad.add_(param.grad)
    param.grad = None


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
