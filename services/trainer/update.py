"""The GRPO actor update: mini-batches x epochs of Megatron forward/backward, Adam, LR schedule.

Owns the optimisation loop around the loss in `grpo_loss.py`:
- The global batch (all rows of one iteration) is cut into mini-batches of `mini_batch_rows`
  (`rl_config.mini_batch_size` prompts x `n_samples_per_prompt`), optionally shuffled per epoch
  (`shuffle_mini_batch`, seeded by (seed, step, epoch) so every rank draws the same order), for
  `epochs` passes; one optimizer step per mini-batch.
- Each data-parallel rank runs its share of a mini-batch in micro-batches of `micro_batch_size` rows
  through Megatron's schedule, which averages the micro-batch losses (token mean per micro-batch,
  mean over the mini-batch, as MindSpeed-RL).
- Optimizer: Megatron-core 0.16.1 without apex/TransformerEngine steps its FP32Optimizer with
  `torch.optim.AdamW`; on CPU its wrapper (`get_megatron_optimizer`) allocates on "cuda", so rlfabric
  steps the same `torch.optim.AdamW` directly, with Megatron's parameter groups (no weight decay on
  biases and 1-D parameters), Megatron's gradient norm (`get_grad_norm_fp32` over the model-parallel
  group, TP duplicates and shared weights counted once) and clip rule (scale by
  clip_grad / (norm + 1e-6) when below 1), and Megatron's `OptimizerParamScheduler` (one increment
  per optimizer step). Data-parallel gradients are averaged with an all-reduce, and tied embeddings
  split across pipeline stages are summed over Megatron's embedding group, which is what Megatron's
  DDP `finalize_model_grads` does. The same code runs on accelerators.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from services.trainer import grpo_loss, megatron_compat
from services.trainer.step import (
    SequenceRows,
    dp_share,
    gather_response_logits,
    make_micro_batch,
    response_slices,
    run_micro_batches,
)

METRIC_KEYS = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "grad_norm",
    "actor/lr",
)


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """Adam and LR schedule (names as `megatron_training` keys)."""

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


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """One iteration's optimisation settings (names as `rl_config` / `megatron_training` keys)."""

    micro_batch_size: int = 1
    mini_batch_rows: int = 0  # rows per optimizer step; 0 = the whole batch
    epochs: int = 1
    shuffle_mini_batch: bool = False
    seed: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    kl_penalty: str = "low_var_kl"
    use_kl: bool = True
    entropy_coeff: float = 0.0
    token_level_loss: bool = True
    # Truncation of the off-policy importance weight (rlfabric.importance_sampling_cap); only applied to an
    # Experience that carries behaviour log-probs (pipelined mode).
    is_cap: float = 2.0
    # Versions a trained sample may lag the actor (rlfabric.max_staleness): the Update RPC's version fence.
    max_staleness: int = 0


@dataclasses.dataclass
class Experience:
    """One global batch for Update: rows and their GRPO inputs (packed like the rows' responses)."""

    rows: SequenceRows
    advantages: torch.Tensor  # float32 [B]
    old_log_probs: torch.Tensor | None  # float32 [sum(response_lengths)] or None (on-policy)
    ref_log_probs: torch.Tensor | None  # same, or None (no KL)
    # The rollout's log-probs of the samples (the behaviour policy), same layout; None when every sample is
    # on-policy (synchronous mode): then no importance weight is applied.
    behavior_log_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, t = len(self.rows), self.rows.num_response_tokens
        self.advantages = torch.as_tensor(self.advantages, dtype=torch.float32).reshape(-1)
        if self.advantages.numel() != n:
            raise ValueError(f"advantages has {self.advantages.numel()} values for {n} sequences")
        for name in ("old_log_probs", "ref_log_probs", "behavior_log_probs"):
            v = getattr(self, name)
            if v is not None and v.numel() == 0:
                v = None
            if v is not None:
                v = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
                if v.numel() != t:
                    raise ValueError(f"{name} has {v.numel()} values for {t} response tokens")
            setattr(self, name, v)


# Most float32 logits one chunk of the no-grad entropy pass holds: ~110 tokens of a 150k vocabulary.
ENTROPY_CHUNK_BYTES = 64 << 20


def entropy_without_grad(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token entropy of softmax(logits / temperature), `[b, R]`, for the `actor/entropy` metric.

    The seed logs `actor/entropy` every iteration (MindSpeed-RL computes it only with an entropy bonus and
    logs 0 otherwise). Without a bonus it needs no gradient, so it is computed here without a graph and in
    chunks of tokens of at most ENTROPY_CHUNK_BYTES of logits, instead of a second [b, R, V] softmax: at a
    150k vocabulary its extra memory stays ~4 x 64 MiB whatever the batch.

    Args:
        logits: `[b, R, V]` response-position logits (full vocabulary).
        temperature: the sampling temperature (> 0), as for the log-probs.
    """
    b, r, v = logits.shape
    flat = logits.detach().reshape(-1, v)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = max(1, ENTROPY_CHUNK_BYTES // (v * 4))
    with torch.no_grad():
        for i in range(0, flat.shape[0], step):
            z = flat[i : i + step].float() / temperature
            log_norm = torch.logsumexp(z, dim=-1, keepdim=True)
            # H = log Z - sum_v p_v z_v with p = exp(z - log Z)
            out[i : i + step] = (log_norm - (torch.exp(z - log_norm) * z).sum(-1, keepdim=True)).squeeze(-1)
    return out.reshape(b, r)


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
    """(torch AdamW, Megatron OptimizerParamScheduler) for `model`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.AdamW(
        param_groups(model),
        lr=opts.lr,
        betas=(opts.adam_beta1, opts.adam_beta2),
        eps=opts.adam_eps,
        weight_decay=opts.weight_decay,
    )
    decay_steps = opts.lr_decay_iters or opts.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
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


def finalize_grads(model) -> None:
    """Average gradients over data-parallel ranks; sum tied-embedding grads across pipeline ends."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        group = ps.get_data_parallel_group()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dp)
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        shared = model.shared_embedding_or_output_weight() if hasattr(model, "shared_embedding_or_output_weight") else None
        if shared is not None and getattr(model, "share_embeddings_and_output_weights", False):
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())


def grad_norm_and_clip(model, clip_grad: float) -> float:
    """Megatron's total L2 grad norm over the model-parallel group; clip when clip_grad > 0."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [
        p.grad
        for p in params
        if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
    ]
    with megatron_compat.cpu_device_mode():
        norm = float(get_grad_norm_fp32(grads, grad_stats_parallel_group=ps.get_model_parallel_group()))
    if clip_grad > 0:
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
    return norm


def mini_batches(n: int, opts: UpdateOptions, step: int, epoch: int) -> list[list[int]]:
    """Row indices of each mini-batch of one epoch (same on every rank)."""
    size = opts.mini_batch_rows or n
    if n % size:
        raise ValueError(f"the batch has {n} rows, not a multiple of the mini-batch size {size} rows")
    if opts.shuffle_mini_batch:
        g = torch.Generator().manual_seed(opts.seed * 1_000_003 + step * 1009 + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    return [order[i : i + size] for i in range(0, n, size)]


def grpo_update(
    model,
    optimizer,
    scheduler,
    exp: Experience,
    opts: UpdateOptions,
    *,
    temperature: float,
    kl_coef: float,
    clip_grad: float,
    step: int = 0,
) -> dict[str, float]:
    """One iteration's update; returns the averaged metrics (identical on every rank)."""
    from megatron.core import parallel_state as ps

    if opts.use_kl and exp.ref_log_probs is None:
        # A KL run (init_kl_coef != 0) that trained without its KL term would diverge silently from the config.
        raise ValueError("ref_log_probs is required: this trainer's loss has a KL term (rl_config.init_kl_coef != 0), "
                         "so every UpdateRequest must carry the reference model's log-probs")
    pp = ps.get_pipeline_model_parallel_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mb_metrics: list[dict[str, float]] = []
    step_metrics: list[tuple[float, float]] = []

    loss_fn = _micro_batch_loss(exp, opts, temperature, kl_coef)
    model.train()
    for epoch in range(opts.epochs):
        for mini in mini_batches(len(exp.rows), opts, step, epoch):
            share = [mini[i] for i in dp_share(len(mini), dp, dp_rank)]
            if len(share) % opts.micro_batch_size and pp > 1:
                raise ValueError(
                    f"{len(share)} rows per data-parallel rank is not a multiple of micro_batch_size "
                    f"{opts.micro_batch_size} (needed with pipeline parallelism)"
                )
            chunks = [share[i : i + opts.micro_batch_size] for i in range(0, len(share), opts.micro_batch_size)]
            seq_len = max(exp.rows.max_len(), 1) if pp > 1 else 0
            mbs = [make_micro_batch(exp.rows, c, seq_len=seq_len) for c in chunks]
            for p in model.parameters():
                p.grad = None
            out = run_micro_batches(model, mbs, loss_fn, forward_only=False)
            if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
                mb_metrics.extend(out)
            finalize_grads(model)
            norm = grad_norm_and_clip(model, clip_grad)
            lr = optimizer.param_groups[0]["lr"]
            if math.isfinite(norm):
                optimizer.step()
                scheduler.step(increment=1)
            step_metrics.append((norm, lr))
    return _reduce_metrics(mb_metrics, step_metrics, exp.behavior_log_probs is not None)


def _micro_batch_loss(exp: Experience, opts: UpdateOptions, temperature: float, kl_coef: float):
    """The loss function Megatron's schedule calls per micro-batch: (logits, micro-batch) -> (loss, metrics)."""

    def loss_fn(logits: torch.Tensor, mb: dict):
        logits = gather_response_logits(logits, mb)
        dev = logits.device
        tokens = mb["resp_tokens"].to(dev)
        logp, ent = grpo_loss.compute_log_probs(logits, tokens, temperature, with_entropy=opts.entropy_coeff != 0)
        if ent is None:
            ent = entropy_without_grad(logits, temperature)
        rows_idx = [i for i in mb["rows"] if i >= 0]
        width = logp.shape[1]
        mask = mb["response_mask"].to(dev)[: len(rows_idx)]
        logp, ent = logp[: len(rows_idx)], ent[: len(rows_idx)]
        old = None if exp.old_log_probs is None else response_slices(exp.old_log_probs, exp.rows, rows_idx, width)
        ref = None if exp.ref_log_probs is None else response_slices(exp.ref_log_probs, exp.rows, rows_idx, width)
        behavior = (None if exp.behavior_log_probs is None
                    else response_slices(exp.behavior_log_probs, exp.rows, rows_idx, width).to(dev))
        return grpo_loss.grpo_loss(
            logp,
            None if old is None else old.to(dev),
            None if ref is None else ref.to(dev),
            exp.advantages[rows_idx].to(dev),
            mask,
            clip_ratio=opts.clip_ratio,
            clip_ratio_low=opts.clip_ratio_low,
            clip_ratio_high=opts.clip_ratio_high,
            kl_penalty=opts.kl_penalty,
            kl_coef=kl_coef,
            use_kl=opts.use_kl,
            entropy_coeff=opts.entropy_coeff,
            entropy=ent,
            token_level_loss=opts.token_level_loss,
            behavior_log_probs=behavior,
            is_cap=opts.is_cap,
        )

    return loss_fn


def _reduce_metrics(mb_metrics: list[dict[str, float]], step_metrics: list[tuple[float, float]],
                    off_policy: bool = False) -> dict[str, float]:
    """Mean of every micro-batch's metrics over all ranks that computed a loss, plus step means."""
    keys = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/loss")
    if off_policy:  # decided by the batch, not by this rank's metrics: every rank all-reduces the same shape
        keys = (*keys, "actor/is_weight_mean", "actor/is_clipfrac")
    sums = torch.tensor([[sum(m[k] for m in mb_metrics) for k in keys] + [float(len(mb_metrics))]], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        sums = sums.to(dev)
        dist.all_reduce(sums)
        sums = sums.cpu()
    count = max(float(sums[0, -1]), 1.0)
    result = {k: float(sums[0, i]) / count for i, k in enumerate(keys)}
    result["grad_norm"] = sum(n for n, _ in step_metrics) / max(len(step_metrics), 1)
    result["actor/lr"] = sum(lr for _, lr in step_metrics) / max(len(step_metrics), 1)
    return result
