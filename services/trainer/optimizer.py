"""The actor's optimizer: Megatron's mixed precision and distributed optimizer, on any torch backend.

Megatron-core's own optimizer wrappers (`get_megatron_optimizer`: Float16OptimizerWithFloat16Params,
DistributedOptimizer over DDP's param-and-grad buffers) allocate on "cuda" by name and use CUDA streams, so
on a CPU host they do not run. `TrainerOptimizer` is the same algorithm written once against plain
torch.distributed (gloo, NCCL or HCCL) and steps torch's AdamW, which is what Megatron-core without apex or
TransformerEngine steps too.

What a step is (as Megatron does it):
- **Main gradients.** Every trainable parameter gets `main_grad`, a view into one contiguous gradient buffer;
  a hook adds each micro-batch's `.grad` into it and frees `.grad`. The buffer is fp32 whenever the optimizer
  keeps fp32 master weights (Megatron-LM forces `accumulate_allreduce_grads_in_fp32` for bf16), so gradients
  accumulate over micro-batches and are reduced over data-parallel ranks in fp32.
- **Reduction** (Megatron's `finalize_model_grads`): weights replicated over TP whose inputs differ per TP rank
  (norms under sequence parallelism, Qwen3's q/k norms) are summed over TP; tied embeddings split across
  pipeline ends are summed over the embedding group; then the buffer is averaged over data-parallel ranks, with
  an all-reduce, or with the distributed optimizer a reduce-scatter that leaves each rank the average of only
  the part it owns. The TP and embedding sums come before the data-parallel step (Megatron orders them after
  and pads its buckets so that both orders agree; the sums are linear either way). Expert-parallel weights sit
  in buckets of their own, reduced, sharded and counted in the norm over their groups (expert_grads.py).
- **Norm and clipping** on the fp32 main grads: Megatron's `get_grad_norm_fp32` (TP duplicates and shared
  weights counted once) over the model-parallel group, or over every rank with the distributed optimizer, whose
  data-parallel ranks hold disjoint parts; grads are scaled by clip_grad / (norm + 1e-6) when that is below 1.
  A step whose norm is not finite is skipped.
- **Adam** on the main parameters: fp32 master copies of bf16 weights (Megatron's mixed precision: fp32 master
  weights and fp32 Adam moments), or the fp32 weights themselves. With `use_distributed_optimizer` each
  data-parallel rank holds and steps only its 1/DP part of the master weights and moments (Megatron's
  DistributedOptimizer: the buffer is cut into buckets, each bucket padded to a multiple of DP and split
  evenly over the ranks); the updated parts are then all-gathered so every rank has the whole model again.
- **Copy back**: bf16 model parameters are set to the round-to-nearest (ties to even) cast of the fp32
  masters after every step, so the model's weights (what the forward pass, the weight sync and the
  checkpoint's `model` see) are always exactly the masters cast to the parameter dtype.

Checkpoints (`state_dict` / `load_state_dict`) hold one layout whatever the optimizer's sharding: per
parameter (canonical Megatron name), its full fp32 master weights and Adam moments, gathered from the
data-parallel ranks to the one that writes. A run therefore resumes with another data-parallel size, or
with the distributed optimizer switched on or off, and each rank takes its own part again (a reshard).

`reuse_fp32_param` (MindSpeed's memory trick, done here on every platform): a bf16 weight's fp32 master is kept
as the bf16 parameter itself plus a 16-bit residual, `master bits = (bf16 bits << 16) + residual` exactly, so a
master costs 2 bytes instead of 4. For that the parameter must be the master rounded to nearest with ties away
from zero (MindSpeed's int32 trick) instead of torch's ties to even: the two differ only where the fp32 value
lies exactly halfway between two bf16 values. The fp32 masters exist only while Adam steps them, a group of
parameters of at most `_REUSE_CHUNK` elements at a time.

`OptimizerOptions.master_weights=False` (no config key sets it) steps bf16 weights in place with bf16 gradients
and moments: the pure low-precision baseline that benchmarks and tests measure mixed precision against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from services.trainer import expert_grads
from services.trainer.model import canonical_name, unwrap

# `state_dict()["format"]`: the layout described in the module docstring.
STATE_FORMAT = "rlfabric-adam-fp32/1"
# Megatron pads each parameter's start in a sharded buffer to 64 elements and each bucket's end to a
# multiple of lcm(DP, 128), for aligned device copies.
_PARAM_ALIGN = 64
_BUCKET_ALIGN = 128
# reuse_fp32_param: elements of fp32 masters rebuilt at once for Adam (256 MiB), and of bit arithmetic at once.
_REUSE_CHUNK = 1 << 26
_BITS_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """Adam, LR schedule and precision (names as `megatron_training` keys)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    train_iters: int = 1000
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    reuse_fp32_param: bool = False
    # Not a config key: False trains bf16 weights without fp32 masters (the measured baseline; see module docstring).
    master_weights: bool = True


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


def build_optimizer(model, opts: OptimizerOptions):
    """(TrainerOptimizer, Megatron OptimizerParamScheduler) for `model` (parallel_state initialised)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = TrainerOptimizer(model, opts)
    decay_steps = opts.lr_decay_iters or opts.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer.optimizer,
        init_lr=0.0 if opts.lr_warmup_iters else opts.lr,
        max_lr=opts.lr,
        min_lr=opts.min_lr,
        lr_warmup_steps=opts.lr_warmup_iters,
        lr_decay_steps=max(decay_steps, opts.lr_warmup_iters + 1),
        lr_decay_style=opts.lr_decay_style,
        start_wd=opts.weight_decay,
        end_wd=opts.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def optimizer_memory(optimizer: TrainerOptimizer) -> dict[str, int]:
    """This rank's bytes of `params`, `grads` (main-grad buffer), `master` (fp32 master weights it holds) and
    `optimizer_states` (Adam moments and step counters), counted from the tensors."""
    return optimizer.memory_bytes()


@dataclasses.dataclass
class _Bucket:
    start: int  # [start, end) in the gradient buffer; (end - start) is a multiple of its group's size when sharded
    end: int
    expert: bool = False  # holds expert-parallel weights: reduced and sharded over the expert-data-parallel group


@dataclasses.dataclass
class _Slot:
    """Where one trainable parameter sits in the gradient buffer."""

    name: str  # canonical Megatron name
    param: torch.nn.Parameter
    offset: int
    bucket: int


@dataclasses.dataclass
class _Piece:
    """The part [lo, hi) of one parameter's flattened elements that this rank's Adam steps (all of it unsharded).

    `main` is the tensor Adam steps: an fp32 master copy (`own_master`; with reuse_fp32_param rebuilt from the
    parameter and `residual` only during a step), the model parameter itself (plain optimizer, no master), or,
    sharded without master, a tensor bound to the parameter's elements only during a step (a lasting view would
    keep an offloaded parameter's storage alive).
    """

    slot: _Slot
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


class TrainerOptimizer:
    """Mixed-precision AdamW over main gradients, optionally sharded over data-parallel ranks (module docstring)."""

    def __init__(self, model, opts: OptimizerOptions) -> None:
        self.model, self.opts = model, opts
        self.distributed = opts.use_distributed_optimizer
        dense = expert_grads.dense_group()
        self.dp_group, self.dp, self.dp_rank = dense.group, dense.size, dense.rank
        named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        # Expert-parallel weights after the others, in buckets of their own (Megatron's DDP: expert buffers).
        named.sort(key=lambda np_: expert_grads.is_expert(np_[1]))
        self.with_experts = expert_grads.expert_parallel(model)
        self._groups = {False: dense, True: expert_grads.expert_group() if self.with_experts else dense}
        # A bf16 model can hold fp32 weights (Megatron's local-spec norms); as in Megatron's Float16Optimizer
        # those are stepped in place, and only the low-precision ones get fp32 masters.
        dtypes = {p.dtype for _, p in named}
        low = [d for d in dtypes if d != torch.float32]
        if len(low) > 1:
            raise ValueError(f"the trainer's parameters mix low-precision dtypes {sorted(map(str, low))}")
        self.mixed = bool(low) and opts.master_weights
        self.grad_dtype = low[0] if low and not opts.master_weights else torch.float32
        # The all-gather after a sharded step moves parameters in their dtype when they share one; fp32 holds a
        # bf16 value exactly, so a model that mixes dtypes is gathered in fp32.
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.reuse = opts.reuse_fp32_param
        if self.reuse and not (self.mixed and low[0] == torch.bfloat16):
            raise ValueError("reuse_fp32_param needs bf16 weights with fp32 master weights (bf16: true), as in MindSpeed")
        self.device = named[0][1].device
        self.slots, self.buckets, numel = self._layout(named)
        self.grad_buffer: torch.Tensor | None = torch.zeros(numel, dtype=self.grad_dtype, device=self.device)
        self._bind_main_grads()
        for slot in self.slots:
            # The optimizer built last owns the model's gradients: an earlier one's hook would empty `.grad` first.
            old = getattr(slot.param, "_main_grad_hook", None)
            if old is not None:
                old.remove()
            slot.param._main_grad_hook = slot.param.register_post_accumulate_grad_hook(_accumulate_main_grad)
        self.pieces = [piece for slot in self.slots if (piece := self._piece(slot)) is not None]
        self._norm_pieces = [pc for pc in self.pieces if expert_grads.counts_for_norm(pc.slot.param)]
        self._tp_summed = self._tp_summed_slots()
        groups = param_groups(model)
        for g in groups:
            members = {id(p) for p in g["params"]}
            g["params"] = [pc.main for pc in self.pieces if id(pc.slot.param) in members]
        self.optimizer = torch.optim.AdamW(
            groups, lr=opts.lr, betas=(opts.adam_beta1, opts.adam_beta2), eps=opts.adam_eps,
            weight_decay=opts.weight_decay,
        )

    # ---- layout ---------------------------------------------------------------------------------
    def _layout(self, named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list[_Slot], list[_Bucket], int]:
        """Slots and buckets of the gradient buffer (Megatron's DDP layout, forward parameter order).

        Unsharded: one bucket, no padding. Sharded: buckets of at least max(40M, 1M x DP) elements (the size
        Megatron's DDP uses when it overlaps the reduction), so the all-gather after a step needs one bucket
        of scratch memory, not the model's.
        """
        bucket_size = max(40_000_000, 1_000_000 * self.dp) if self.distributed else None
        slots, buckets = [], []
        offset = start = 0
        expert = False
        for name, p in named:
            if expert_grads.is_expert(p) != expert:  # the experts start a bucket of their own
                if start < offset:
                    start = offset = self._close_bucket(buckets, start, offset, expert)
                expert = True
            if self.distributed:
                offset = _round_up(offset, _PARAM_ALIGN)
            slots.append(_Slot(name, p, offset, len(buckets)))
            offset += p.numel()
            if bucket_size is not None and offset - start >= bucket_size:
                start = offset = self._close_bucket(buckets, start, offset, expert)
        if not buckets or start < offset:
            start = offset = self._close_bucket(buckets, start, offset, expert)
        return slots, buckets, offset

    def _close_bucket(self, buckets: list[_Bucket], start: int, end: int, expert: bool) -> int:
        if self.distributed:
            end = start + _round_up(end - start, math.lcm(self._groups[expert].size, _BUCKET_ALIGN))
        buckets.append(_Bucket(start, end, expert))
        return end

    def _shard(self, bucket: _Bucket, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of `bucket` in the buffer that `rank` (default: this one) of its group owns."""
        group = self._groups[bucket.expert]
        rank = group.rank if rank is None else rank
        size = (bucket.end - bucket.start) // group.size
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def _piece(self, slot: _Slot) -> _Piece | None:
        n, p = slot.param.numel(), slot.param
        if self.distributed:
            lo, hi = self._shard(self.buckets[slot.bucket])
            lo, hi = max(lo, slot.offset) - slot.offset, min(hi, slot.offset + n) - slot.offset
            if hi <= lo:
                return None
        else:
            lo, hi = 0, n
        if self.mixed and p.dtype != torch.float32:
            if self.reuse:  # the master is the parameter exactly: a zero residual
                empty = torch.empty(0, dtype=torch.float32, device=p.device)
                return _Piece(slot, lo, hi, empty, True, torch.zeros(hi - lo, dtype=torch.int16, device=p.device))
            main = p.detach().reshape(-1)[lo:hi].to(torch.float32, copy=True)
            return _Piece(slot, lo, hi, main, True)
        if not self.distributed:
            return _Piece(slot, lo, hi, p, False)
        return _Piece(slot, lo, hi, torch.empty(0, dtype=p.dtype, device=p.device), False)

    def _tp_summed_slots(self) -> list[_Slot]:
        """Weights replicated over TP whose gradient each TP rank computes from its own part (Megatron's
        `_allreduce_non_tensor_model_parallel_grads`): norms under sequence parallelism, and q/k norms."""
        config = getattr(unwrap(self.model), "config", None)
        sp = bool(getattr(config, "sequence_parallel", False))
        qk = bool(getattr(config, "qk_layernorm", False))
        return [s for s in self.slots if (sp and getattr(s.param, "sequence_parallel", False))
                or (qk and ("q_layernorm" in s.name or "k_layernorm" in s.name))]

    def _bind_main_grads(self) -> None:
        for slot in self.slots:
            p = slot.param
            p.main_grad = (None if self.grad_buffer is None
                           else self.grad_buffer[slot.offset : slot.offset + p.numel()].view(p.shape))

    # ---- the torch.optim surface the scheduler and the update loop use ----------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        for slot in self.slots:
            slot.param.grad = None

    def reload_model_params(self) -> None:
        """Master weights := the model's parameters (after weights were loaded into the model)."""
        with torch.no_grad():
            for pc in self.pieces:
                if pc.residual is not None:
                    pc.residual.zero_()
                elif pc.own_master:
                    pc.main.copy_(pc.slot.param.detach().reshape(-1)[pc.lo : pc.hi])

    # ---- one optimizer step -----------------------------------------------------------------------
    def step(self, clip_grad: float) -> float:
        """Reduce the main grads, clip them, step Adam and update the model; returns the grad norm.

        A collective of the whole trainer group. A non-finite norm skips the update (the norm is returned).
        """
        self._require_grads()
        self._reduce_grads()
        norm = self._grad_norm()
        if not math.isfinite(norm):
            return norm
        grads = [self._main_grad(pc) for pc in self.pieces]
        if clip_grad > 0:
            coeff = clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for g in grads:
                    g.mul_(coeff)
        for chunk in self._adam_chunks():
            self._adam(chunk, [grads[i] for i in chunk])
        self._update_model_params()
        return norm

    def _adam_chunks(self) -> list[list[int]]:
        """Indices of the pieces Adam steps together: all of them, or with reuse_fp32_param groups of at most
        _REUSE_CHUNK elements (a larger piece alone), whose masters exist only for their step."""
        if not self.reuse:
            return [list(range(len(self.pieces)))]
        chunks: list[list[int]] = [[]]
        size = 0
        for i, pc in enumerate(self.pieces):
            if chunks[-1] and size + pc.numel > _REUSE_CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += pc.numel
        return chunks

    def _adam(self, chunk: list[int], grads: list[torch.Tensor]) -> None:
        """Adam on the pieces `chunk` (only pieces with a grad move); the model keeps their new values."""
        pieces = [self.pieces[i] for i in chunk]
        for pc, g in zip(pieces, grads, strict=True):
            if pc.residual is not None:
                pc.main.data = self._master_value(pc)
            elif not pc.own_master and self.distributed:
                pc.main.data = pc.slot.param.data.view(-1)[pc.lo : pc.hi]  # a view: Adam writes the weights
            # Only the pure low-precision baseline's fp32 weights (norms) see a grad of another dtype.
            pc.main.grad = g.view(pc.main.shape).to(pc.main.dtype)
        self.optimizer.step()
        for pc in pieces:
            pc.main.grad = None
            if pc.residual is not None:
                split_master(pc.main, pc.slot.param.data.view(-1)[pc.lo : pc.hi], pc.residual)
            if pc.residual is not None or (not pc.own_master and self.distributed):
                pc.main.data = torch.empty(0, dtype=pc.main.dtype, device=pc.main.device)

    def _master_value(self, pc: _Piece) -> torch.Tensor:
        """This piece's fp32 master weights (rebuilt from parameter and residual with reuse_fp32_param)."""
        own = pc.slot.param.detach().view(-1)[pc.lo : pc.hi]
        if pc.residual is not None:
            return join_master(own, pc.residual)
        return pc.main if pc.own_master else own.float()

    def _local_value(self, pc: _Piece) -> torch.Tensor:
        """The piece's new weights as the model stores them, after its Adam step."""
        if pc.own_master and pc.residual is None:
            return pc.main.to(pc.slot.param.dtype)
        return pc.slot.param.detach().view(-1)[pc.lo : pc.hi]  # stepped in place, or split into it

    def _require_grads(self) -> None:
        if self.grad_buffer is None:
            raise RuntimeError("the gradient buffer is offloaded; onload grads before a step")

    def _main_grad(self, pc: _Piece) -> torch.Tensor:
        return self.grad_buffer[pc.buf_lo : pc.buf_lo + pc.numel]

    def _reduce_grads(self) -> None:
        from megatron.core import parallel_state as ps

        if self._tp_summed and ps.get_tensor_model_parallel_world_size() > 1:
            grads = [s.param.main_grad for s in self._tp_summed]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(synced)
        model = unwrap(self.model)
        if (ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group()
                and getattr(model, "share_embeddings_and_output_weights", False)):
            shared = model.shared_embedding_or_output_weight()
            if shared is not None and getattr(shared, "main_grad", None) is not None:
                dist.all_reduce(shared.main_grad, group=ps.get_embedding_group())
        if self.dp == 1:
            return
        for bucket in self.buckets:
            # Experts: summed over the expert-data-parallel group, then divided by DP as well (expert_grads.py).
            group = self._groups[bucket.expert]
            data = self.grad_buffer[bucket.start : bucket.end]
            if self.distributed:
                lo, hi = self._shard(bucket)
                local = self.grad_buffer[lo:hi]
                if group.size > 1:
                    dist.reduce_scatter_tensor(local, data, group=group.group)
                local.div_(self.dp)
            else:
                if group.size > 1:
                    dist.all_reduce(data, group=group.group)
                data.div_(self.dp)

    def _grad_norm(self) -> float:
        # Sharded, the data-parallel ranks hold disjoint parts of the gradient: the sum of squares runs over
        # every rank of the trainer (TP x PP x DP), as Megatron's distributed optimizer does.
        dense = [self._main_grad(pc) for pc in self._norm_pieces if not self.buckets[pc.slot.bucket].expert]
        experts = [self._main_grad(pc) for pc in self._norm_pieces if self.buckets[pc.slot.bucket].expert]
        return expert_grads.grad_norm(dense, experts, distributed=self.distributed, with_experts=self.with_experts)

    @torch.no_grad()
    def _update_model_params(self) -> None:
        if not self.distributed:
            for pc in self.pieces:
                if pc.own_master and pc.residual is None:
                    pc.slot.param.data.view(-1).copy_(pc.main)
            return
        by_bucket: dict[int, list[_Piece]] = {}
        for pc in self.pieces:
            by_bucket.setdefault(pc.slot.bucket, []).append(pc)
        for b, bucket in enumerate(self.buckets):
            full = torch.empty(bucket.end - bucket.start, dtype=self.gather_dtype, device=self.device)
            lo, hi = self._shard(bucket)
            local = full[lo - bucket.start : hi - bucket.start]
            for pc in by_bucket.get(b, []):
                at = pc.buf_lo - lo
                # In the parameter's dtype first: an fp32 gather buffer must carry the bf16 value exactly.
                local[at : at + pc.numel].copy_(self._local_value(pc))
            dist.all_gather_into_tensor(full, local, group=self._groups[bucket.expert].group)
            for slot in self.slots:
                if slot.bucket == b:
                    at = slot.offset - bucket.start
                    slot.param.data.view(-1).copy_(full[at : at + slot.param.numel()])

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        """The layout of the module docstring, on data-parallel rank 0 (the rank that writes; None on the
        others). Collective over the data-parallel group when sharded: each rank sends its part.

        With expert parallelism the experts' state is whole on expert-data-parallel rank 0 of each EP rank: data-
        parallel rank 0 returns every parameter it holds, and an expert-data-parallel rank 0 that is not data-
        parallel rank 0 returns its experts' state only (its expert checkpoint shard's writer).
        """
        step = self._step_count()
        params: dict[str, dict[str, torch.Tensor]] = {}
        kinds = self._state_kinds(step)
        if self.distributed:
            params = self._gather_state(kinds)
        writes = {expert: self._groups[expert].rank == 0 for expert in (False, True)}
        if self.dp_rank != 0 and not (self.with_experts and writes[True]):
            return None
        if not self.distributed:
            for pc in self.pieces:
                if writes[self.buckets[pc.slot.bucket].expert]:
                    entry = {k: self._piece_value(pc, k).reshape(pc.slot.param.shape) for k in kinds}
                    params[pc.slot.name] = entry
        return {
            "format": STATE_FORMAT,
            "step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "params": params,
            "master_weights": self.mixed,
            "data_parallel_size": self.dp,
            "distributed": self.distributed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Loads `state_dict()`'s layout, saved at any data-parallel size, sharded or not (this rank takes its
        part), or a torch AdamW state dict of the trainer before this module (parameters in group order)."""
        if "format" not in state and "state" in state and "param_groups" in state:
            state = self._from_torch_adamw(state)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state has format {state.get('format')!r}; this trainer reads {STATE_FORMAT!r}"
                             " (set no_load_optim: true to start the optimizer afresh)")
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"optimizer state has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        step, params = int(state["step"]), state["params"]
        missing = [pc.slot.name for pc in self.pieces if pc.slot.name not in params] if step else []
        if missing:
            raise ValueError(f"optimizer state lacks parameters {missing[:5]} (of {len(missing)})")
        self.optimizer.state.clear()
        with torch.no_grad():
            if self.reuse:
                # Every rank rounds the whole masters its way (ties away from zero), so the parameters agree
                # across data-parallel ranks whatever rounding the checkpoint's weights had.
                for slot in self.slots:
                    master = params.get(slot.name, {}).get("main_param")
                    if master is not None and slot.param.dtype == torch.bfloat16:
                        scratch = torch.empty(slot.param.numel(), dtype=torch.int16, device=self.device)
                        split_master(master.reshape(-1).to(self.device, torch.float32),
                                     slot.param.data.view(-1), scratch)
            for pc in self.pieces:
                entry = params.get(pc.slot.name, {})
                if pc.own_master and "main_param" in entry:  # fp32 weights are the model's: loaded with it
                    master = self._slice(entry["main_param"], pc).float()
                    if pc.residual is not None:
                        split_master(master, pc.slot.param.data.view(-1)[pc.lo : pc.hi], pc.residual)
                    else:
                        pc.main.copy_(master)
                if step:
                    dtype = pc.main.dtype
                    shape = (pc.numel,) if pc.main.numel() == 0 else pc.main.shape
                    self.optimizer.state[pc.main] = {
                        "step": torch.tensor(float(step), dtype=torch.float32),
                        "exp_avg": self._slice(entry["exp_avg"], pc).to(dtype).reshape(shape).clone(),
                        "exp_avg_sq": self._slice(entry["exp_avg_sq"], pc).to(dtype).reshape(shape).clone(),
                    }

    def _slice(self, full: torch.Tensor, pc: _Piece) -> torch.Tensor:
        if full.numel() != pc.slot.param.numel():
            raise ValueError(f"optimizer state of {pc.slot.name} has {full.numel()} elements, the parameter "
                             f"{pc.slot.param.numel()}")
        return full.reshape(-1)[pc.lo : pc.hi].to(self.device)

    def _from_torch_adamw(self, sd: dict) -> dict:
        """A torch AdamW state dict (parameters numbered in param_groups order) as STATE_FORMAT."""
        order = [p for g in param_groups(self.model) for p in g["params"]]
        names = {id(s.param): s.name for s in self.slots}
        params, steps = {}, set()
        for index, st in sd["state"].items():
            p = order[int(index)]
            params[names[id(p)]] = {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
            steps.add(int(float(st["step"])))
        if len(steps) > 1:
            raise ValueError(f"optimizer state has parameters at different step counts {sorted(steps)}")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return {"format": STATE_FORMAT, "step": steps.pop() if steps else 0, "param_groups": groups, "params": params}

    def _step_count(self) -> int:
        steps = {int(float(st["step"])) for st in self.optimizer.state.values() if "step" in st}
        local = max(steps, default=0)
        if self.distributed and self.dp > 1:
            t = torch.tensor([local], dtype=torch.float64, device=self._comm_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
            local = int(t.item())
        return local

    def _state_kinds(self, step: int) -> list[str]:
        kinds = ["main_param"] if self.mixed else []
        return kinds + (["exp_avg", "exp_avg_sq"] if step else [])

    def _piece_value(self, pc: _Piece, kind: str) -> torch.Tensor:
        if kind == "main_param":
            return self._master_value(pc)
        st = self.optimizer.state.get(pc.main)
        if st is None or kind not in st:
            return torch.zeros(pc.numel, dtype=torch.float32, device=self.device)
        return st[kind]

    def _gather_state(self, kinds: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's full state of `kinds`, gathered bucket by bucket on rank 0 of the bucket's group
        (data-parallel, or expert-data-parallel for experts; to CPU)."""
        params: dict[str, dict[str, torch.Tensor]] = {}
        by_bucket: dict[int, list[_Piece]] = {}
        for pc in self.pieces:
            by_bucket.setdefault(pc.slot.bucket, []).append(pc)
        for b, bucket in enumerate(self.buckets):
            lo, hi = self._shard(bucket)
            for kind in kinds:
                local = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
                for pc in by_bucket.get(b, []):
                    at = pc.buf_lo - lo
                    local[at : at + pc.numel].copy_(self._piece_value(pc, kind).reshape(-1))
                group = self._groups[bucket.expert]
                parts = [torch.empty_like(local) for _ in range(group.size)] if group.rank == 0 else None
                dist.gather(local, parts, group=group.group, group_dst=0)
                if group.rank != 0:
                    continue
                full = torch.cat(parts).cpu()
                for slot in self.slots:
                    if slot.bucket == b:
                        at = slot.offset - bucket.start
                        value = full[at : at + slot.param.numel()].clone().reshape(slot.param.shape)
                        params.setdefault(slot.name, {})[kind] = value
        return params

    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if dist.get_backend(self.dp_group) == "gloo" else self.device

    # ---- offload (services/trainer/offload.py) and memory ------------------------------------------------
    def offload_tensors(self, kind: str) -> list[tuple[torch.Tensor, Any]]:
        """(tensor, restore) pairs the offloader moves for `kind`: "grads" is the main-grad buffer (restored
        with None while out), "optimizer" the master weights and Adam moments (objects keep their identity)."""
        if kind == "grads":
            return [] if self.grad_buffer is None else [(self.grad_buffer, self._set_grad_buffer)]
        if kind != "optimizer":
            raise ValueError(f"the optimizer holds no {kind!r} state")
        out: list[tuple[torch.Tensor, Any]] = []
        for pc in self.pieces:
            if pc.residual is not None:
                out.append((pc.residual, lambda t, pc=pc: setattr(pc, "residual", t)))
            elif pc.own_master:
                out.append((pc.main.data, lambda t, m=pc.main: setattr(m, "data", t)))
        for st in self.optimizer.state.values():
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    out.append((value, lambda t, st=st, key=key: st.__setitem__(key, t)))
        return out

    def _set_grad_buffer(self, t: torch.Tensor | None) -> None:
        self.grad_buffer = t
        self._bind_main_grads()

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes: `params` (the model's), `grads` (main-grad buffer), `master` (fp32 master weights
        held here) and `optimizer_states` (every tensor in Adam's state, step counters included)."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        states = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor))
        return {
            "params": sum(nbytes(p) for p in self.model.parameters()),
            "grads": nbytes(self.grad_buffer),
            "master": sum(nbytes(pc.main if pc.residual is None else pc.residual) for pc in self.pieces
                          if pc.own_master),
            "optimizer_states": states,
        }


def _accumulate_main_grad(param: torch.nn.Parameter) -> None:
    # Megatron's DDP hook: each backward's grad goes into the (fp32) main grad, and `.grad` is freed at once.
    if param.main_grad is None:
        raise RuntimeError("the gradient buffer is offloaded; onload grads before a backward pass")
    param.main_grad.add_(param.grad)
    param.grad = None


def split_master(master: torch.Tensor, param: torch.Tensor, residual: torch.Tensor) -> None:
    """fp32 `master` -> bf16 `param` (nearest, ties away from zero) and int16 `residual`, in place (1-D).

    On the fp32 bits u: hi = (u + 0x8000) >> 16 and residual = u - (hi << 16), which lies in [-0x8000, 0x7fff],
    so `join_master` gives u back exactly. Only NaN bit patterns overflow.
    """
    bits = master.view(torch.int32)
    out = param.view(torch.int16)
    for i in range(0, bits.numel(), _BITS_CHUNK):
        u = bits[i : i + _BITS_CHUNK]
        hi = (u + 0x8000) >> 16
        residual[i : i + _BITS_CHUNK] = u - (hi << 16)
        out[i : i + _BITS_CHUNK] = hi


def join_master(param: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` cut into bf16 `param` and int16 `residual` (1-D), bit for bit."""
    hi = param.view(torch.int16)
    out = torch.empty(hi.numel(), dtype=torch.int32, device=hi.device)
    for i in range(0, hi.numel(), _BITS_CHUNK):
        out[i : i + _BITS_CHUNK] = (hi[i : i + _BITS_CHUNK].to(torch.int32) << 16) + residual[i : i + _BITS_CHUNK]
    return out.view(torch.float32)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
