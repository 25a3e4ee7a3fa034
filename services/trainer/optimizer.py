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

Modules: the buffer layout, weight-decay groups and pieces are optimizer_layout.py's; checkpoints (one layout
whatever the sharding, so a run resumes at another DP size) optimizer_state.py's.

`reuse_fp32_param` (MindSpeed's memory trick, done here on every platform; reuse_fp32_param.py): a bf16 weight's
fp32 master is kept as the bf16 parameter itself plus a 16-bit residual, 2 bytes instead of 4. The fp32 masters
exist only while Adam steps them, a group of parameters of at most `_REUSE_CHUNK` elements at a time.

`OptimizerOptions.master_weights=False` (no config key sets it) steps bf16 weights in place with bf16 gradients
and moments: the pure low-precision baseline that benchmarks and tests measure mixed precision against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from services.common.config.megatron import MegatronConfig
from services.trainer import expert_grads, optimizer_state
from services.trainer.model import canonical_name, unwrap
from services.trainer.optimizer_layout import (
    Bucket,
    Piece,
    Slot,
    accumulate_main_grad,
    make_piece,
    param_groups,
    plan_buffer,
    shard,
)
from services.trainer.reuse_fp32_param import split_master

# megatron_training as a config that sets none of its keys has it: the defaults of OptimizerOptions.
_SCHEMA = MegatronConfig()

# reuse_fp32_param: elements of fp32 masters rebuilt at once for Adam (256 MiB).
_REUSE_CHUNK = 1 << 26


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """Adam, LR schedule and precision (names as `megatron_training` keys); built from a config by
    services/trainer/options.py. The defaults are the config schema's, but for the keys a config must set."""

    # Required in a config (no schema default): a trainer started without one (tests, `trainer serve` alone).
    lr: float = 1e-6
    train_iters: int = 1000
    min_lr: float = _SCHEMA.min_lr
    lr_decay_style: str = _SCHEMA.lr_decay_style
    lr_warmup_iters: int = 0  # from lr_warmup_fraction (unset: none) and train_iters
    lr_decay_iters: int | None = None  # None: train_iters
    weight_decay: float = _SCHEMA.weight_decay
    adam_beta1: float = _SCHEMA.adam_beta1
    adam_beta2: float = _SCHEMA.adam_beta2
    adam_eps: float = 1e-8  # not a MindSpeed-RL key: Megatron's default
    clip_grad: float = _SCHEMA.clip_grad
    use_distributed_optimizer: bool = _SCHEMA.use_distributed_optimizer
    reuse_fp32_param: bool = _SCHEMA.reuse_fp32_param
    # Not a config key: False trains bf16 weights without fp32 masters (the measured baseline; see module docstring).
    master_weights: bool = True


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
        self.groups = {False: dense, True: expert_grads.expert_group() if self.with_experts else dense}
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
        self.slots, self.buckets, numel = plan_buffer(named, self.groups, distributed=self.distributed, dp=self.dp)
        self.grad_buffer: torch.Tensor | None = torch.zeros(numel, dtype=self.grad_dtype, device=self.device)
        self._bind_main_grads()
        for slot in self.slots:
            # The optimizer built last owns the model's gradients: an earlier one's hook would empty `.grad` first.
            old = getattr(slot.param, "_main_grad_hook", None)
            if old is not None:
                old.remove()
            slot.param._main_grad_hook = slot.param.register_post_accumulate_grad_hook(accumulate_main_grad)
        self.pieces: list[Piece] = []
        for slot in self.slots:
            owned = self.shard(self.buckets[slot.bucket]) if self.distributed else None
            piece = make_piece(slot, owned, mixed=self.mixed, reuse=self.reuse)
            if piece is not None:
                self.pieces.append(piece)
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

    # ---- layout (optimizer_layout.py) -------------------------------------------------------------
    def shard(self, bucket: Bucket, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of `bucket` in the buffer that `rank` (default: this one) of its group owns."""
        return shard(bucket, self.groups[bucket.expert], rank)

    def _tp_summed_slots(self) -> list[Slot]:
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
                pc.main.data = pc.master_value()
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

    def _require_grads(self) -> None:
        if self.grad_buffer is None:
            raise RuntimeError("the gradient buffer is offloaded; onload grads before a step")

    def _main_grad(self, pc: Piece) -> torch.Tensor:
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
            group = self.groups[bucket.expert]
            data = self.grad_buffer[bucket.start : bucket.end]
            if self.distributed:
                lo, hi = self.shard(bucket)
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
        by_bucket: dict[int, list[Piece]] = {}
        for pc in self.pieces:
            by_bucket.setdefault(pc.slot.bucket, []).append(pc)
        for b, bucket in enumerate(self.buckets):
            full = torch.empty(bucket.end - bucket.start, dtype=self.gather_dtype, device=self.device)
            lo, hi = self.shard(bucket)
            local = full[lo - bucket.start : hi - bucket.start]
            for pc in by_bucket.get(b, []):
                at = pc.buf_lo - lo
                # In the parameter's dtype first: an fp32 gather buffer must carry the bf16 value exactly.
                local[at : at + pc.numel].copy_(pc.local_value())
            dist.all_gather_into_tensor(full, local, group=self.groups[bucket.expert].group)
            for slot in self.slots:
                if slot.bucket == b:
                    at = slot.offset - bucket.start
                    slot.param.data.view(-1).copy_(full[at : at + slot.param.numel()])

    # ---- checkpoints (optimizer_state.py) ---------------------------------------------------------
    def state_dict(self) -> dict | None:
        """optimizer_state.py's layout on the writing rank (None on the others); collective when sharded."""
        return optimizer_state.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Loads optimizer_state.py's layout (any data-parallel size, sharded or not) or a torch AdamW state."""
        optimizer_state.load_state_dict(self, state)

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
