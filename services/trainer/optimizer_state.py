"""The actor optimizer's checkpoint (`TrainerOptimizer.state_dict` / `load_state_dict`): one layout whatever
the optimizer's sharding.

Per parameter (canonical Megatron name): its full fp32 master weights (`main_param`, with mixed precision) and
Adam moments (`exp_avg`, `exp_avg_sq`, once a step was taken), gathered from the data-parallel ranks to the one
that writes. A run therefore resumes with another data-parallel size, or with the distributed optimizer switched
on or off, and each rank takes its own part again (a reshard). A torch AdamW state dict of the trainer before
this layout loads too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.trainer.optimizer_layout import Piece, param_groups
from services.trainer.reuse_fp32_param import split_master

if TYPE_CHECKING:
    from services.trainer.optimizer import TrainerOptimizer

# `state_dict()["format"]`: the layout of the module docstring.
STATE_FORMAT = "rlfabric-adam-fp32/1"


def state_dict(opt: TrainerOptimizer) -> dict | None:
    """The layout of the module docstring, on data-parallel rank 0 (the rank that writes; None on the others).
    Collective over the data-parallel group when sharded: each rank sends its part.

    With expert parallelism the experts' state is whole on expert-data-parallel rank 0 of each EP rank: data-
    parallel rank 0 returns every parameter it holds, and an expert-data-parallel rank 0 that is not data-
    parallel rank 0 returns its experts' state only (its expert checkpoint shard's writer).
    """
    step = _step_count(opt)
    params: dict[str, dict[str, torch.Tensor]] = {}
    kinds = (["main_param"] if opt.mixed else []) + (["exp_avg", "exp_avg_sq"] if step else [])
    if opt.distributed:
        params = _gather_state(opt, kinds)
    writes = {expert: opt.groups[expert].rank == 0 for expert in (False, True)}
    if opt.dp_rank != 0 and not (opt.with_experts and writes[True]):
        return None
    if not opt.distributed:
        for pc in opt.pieces:
            if writes[opt.buckets[pc.slot.bucket].expert]:
                params[pc.slot.name] = {k: _piece_value(opt, pc, k).reshape(pc.slot.param.shape) for k in kinds}
    return {
        "format": STATE_FORMAT,
        "step": step,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups],
        "params": params,
        "master_weights": opt.mixed,
        "data_parallel_size": opt.dp,
        "distributed": opt.distributed,
    }


def load_state_dict(opt: TrainerOptimizer, state: dict) -> None:
    """Loads `state_dict()`'s layout, saved at any data-parallel size, sharded or not (this rank takes its part),
    or a torch AdamW state dict of the trainer before this module (parameters in group order)."""
    if "format" not in state and "state" in state and "param_groups" in state:
        state = _from_torch_adamw(opt, state)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"optimizer state has format {state.get('format')!r}; this trainer reads {STATE_FORMAT!r}"
                         " (set no_load_optim: true to start the optimizer afresh)")
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(opt.optimizer.param_groups):
        raise ValueError(f"optimizer state has {len(saved_groups)} parameter groups, this optimizer "
                         f"{len(opt.optimizer.param_groups)}")
    for group, saved in zip(opt.optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    step, params = int(state["step"]), state["params"]
    missing = [pc.slot.name for pc in opt.pieces if pc.slot.name not in params] if step else []
    if missing:
        raise ValueError(f"optimizer state lacks parameters {missing[:5]} (of {len(missing)})")
    opt.optimizer.state.clear()
    with torch.no_grad():
        if opt.reuse:
            # Every rank rounds the whole masters its way (ties away from zero), so the parameters agree
            # across data-parallel ranks whatever rounding the checkpoint's weights had.
            for slot in opt.slots:
                master = params.get(slot.name, {}).get("main_param")
                if master is not None and slot.param.dtype == torch.bfloat16:
                    scratch = torch.empty(slot.param.numel(), dtype=torch.int16, device=opt.device)
                    split_master(master.reshape(-1).to(opt.device, torch.float32), slot.param.data.view(-1), scratch)
        for pc in opt.pieces:
            _load_piece(opt, pc, params.get(pc.slot.name, {}), step)


def _load_piece(opt: TrainerOptimizer, pc: Piece, entry: dict[str, torch.Tensor], step: int) -> None:
    if pc.own_master and "main_param" in entry:  # fp32 weights are the model's: loaded with it
        master = _slice(opt, entry["main_param"], pc).float()
        if pc.residual is not None:
            split_master(master, pc.slot.param.data.view(-1)[pc.lo : pc.hi], pc.residual)
        else:
            pc.main.copy_(master)
    if step:
        dtype = pc.main.dtype
        shape = (pc.numel,) if pc.main.numel() == 0 else pc.main.shape
        opt.optimizer.state[pc.main] = {
            "step": torch.tensor(float(step), dtype=torch.float32),
            "exp_avg": _slice(opt, entry["exp_avg"], pc).to(dtype).reshape(shape).clone(),
            "exp_avg_sq": _slice(opt, entry["exp_avg_sq"], pc).to(dtype).reshape(shape).clone(),
        }


def _slice(opt: TrainerOptimizer, full: torch.Tensor, pc: Piece) -> torch.Tensor:
    if full.numel() != pc.slot.param.numel():
        raise ValueError(f"optimizer state of {pc.slot.name} has {full.numel()} elements, the parameter "
                         f"{pc.slot.param.numel()}")
    return full.reshape(-1)[pc.lo : pc.hi].to(opt.device)


def _from_torch_adamw(opt: TrainerOptimizer, sd: dict) -> dict:
    """A torch AdamW state dict (parameters numbered in param_groups order) as STATE_FORMAT."""
    order = [p for g in param_groups(opt.model) for p in g["params"]]
    names = {id(s.param): s.name for s in opt.slots}
    params, steps = {}, set()
    for index, st in sd["state"].items():
        p = order[int(index)]
        params[names[id(p)]] = {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
        steps.add(int(float(st["step"])))
    if len(steps) > 1:
        raise ValueError(f"optimizer state has parameters at different step counts {sorted(steps)}")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return {"format": STATE_FORMAT, "step": steps.pop() if steps else 0, "param_groups": groups, "params": params}


def _step_count(opt: TrainerOptimizer) -> int:
    steps = {int(float(st["step"])) for st in opt.optimizer.state.values() if "step" in st}
    local = max(steps, default=0)
    if opt.distributed and opt.dp > 1:
        device = torch.device("cpu") if dist.get_backend(opt.dp_group) == "gloo" else opt.device
        t = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=opt.dp_group)
        local = int(t.item())
    return local


def _piece_value(opt: TrainerOptimizer, pc: Piece, kind: str) -> torch.Tensor:
    if kind == "main_param":
        return pc.master_value()
    st = opt.optimizer.state.get(pc.main)
    if st is None or kind not in st:
        return torch.zeros(pc.numel, dtype=torch.float32, device=opt.device)
    return st[kind]


def _gather_state(opt: TrainerOptimizer, kinds: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full state of `kinds`, gathered bucket by bucket on rank 0 of the bucket's group
    (data-parallel, or expert-data-parallel for experts; to CPU)."""
    params: dict[str, dict[str, torch.Tensor]] = {}
    by_bucket: dict[int, list[Piece]] = {}
    for pc in opt.pieces:
        by_bucket.setdefault(pc.slot.bucket, []).append(pc)
    for b, bucket in enumerate(opt.buckets):
        lo, hi = opt.shard(bucket)
        for kind in kinds:
            local = torch.zeros(hi - lo, dtype=torch.float32, device=opt.device)
            for pc in by_bucket.get(b, []):
                at = pc.buf_lo - lo
                local[at : at + pc.numel].copy_(_piece_value(opt, pc, kind).reshape(-1))
            group = opt.groups[bucket.expert]
            parts = [torch.empty_like(local) for _ in range(group.size)] if group.rank == 0 else None
            dist.gather(local, parts, group=group.group, group_dst=0)
            if group.rank != 0:
                continue
            full = torch.cat(parts).cpu()
            for slot in opt.slots:
                if slot.bucket == b:
                    at = slot.offset - bucket.start
                    value = full[at : at + slot.param.numel()].clone().reshape(slot.param.shape)
                    params.setdefault(slot.name, {})[kind] = value
    return params
