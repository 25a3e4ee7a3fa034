"""The actor update: mini-batches x epochs of Megatron forward/backward, Adam, LR schedule.

Owns the optimisation loop (`optimize`, which PPO's critic shares: services/trainer/critic.py) around the loss in
`grpo_loss.py`. The actor's advantages are one per sequence (GRPO and the other outcome estimators, broadcast over
the response tokens) or one per response token (PPO's GAE, `Experience.token_advantages`).
- The global batch (all rows of one iteration) is cut into mini-batches of `mini_batch_rows`
  (`rl_config.mini_batch_size` prompts x `n_samples_per_prompt`), optionally shuffled per epoch
  (`shuffle_mini_batch`, seeded by (seed, step, epoch) so every rank draws the same order), for
  `epochs` passes; one optimizer step per mini-batch.
- Each data-parallel rank runs its share of a mini-batch in micro-batches of `micro_batch_size` rows
  through Megatron's schedule, which averages the micro-batch losses (token mean per micro-batch,
  mean over the mini-batch, as MindSpeed-RL). With `use_dynamic_bsz` the micro-batches follow the
  update token budget and each one's token mean is weighted by its share of the rows; with
  `use_remove_padding` they are packed (services/trainer/packing.py).
- Optimizer (services/trainer/optimizer.py): gradients accumulate into fp32 main grads; one step
  reduces them over data-parallel ranks, clips them by Megatron's norm, steps Adam on fp32 master
  weights (sharded over data-parallel ranks with the distributed optimizer) and updates the model;
  then Megatron's `OptimizerParamScheduler` moves one increment. A step whose gradient norm is not
  finite is skipped, scheduler included. The same code runs on accelerators.
- Mixture-of-experts models: every data-parallel rank of an expert-parallel group runs as many micro-batches
  (padding ones with zero loss; services/trainer/moe.py), and the iteration's metrics carry `moe/aux_loss` and
  `moe/expert_load_max_over_mean` (`moe.moe_metrics`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from services.common.config.megatron import MegatronConfig
from services.common.config.rl import RLConfig
from services.common.config.sections import FabricConfig
from services.trainer import grpo_loss, moe, packing, rollout_correction, routing_replay
from services.trainer.expert_bias import update_expert_bias
from services.trainer.step import (
    SequenceRows,
    gather_response_logits,
    response_slices,
    run_micro_batches,
)

# The per-micro-batch loss metrics the actor's Update averages (grpo_loss's; `actor/loss` the total).
ACTOR_LOSS_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/loss")


# The config schema's defaults: the one home of the defaults below that have a config key, so that a trainer run
# without a config (`trainer serve` without --config, tests) updates as one whose config sets none of those keys.
_RL, _FABRIC = RLConfig(), FabricConfig()


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """One iteration's optimisation settings (names as `rl_config` / `megatron_training` keys); built from a config
    by services/trainer/options.py."""

    # No config default: micro_batch_size is required in a config, mini_batch_rows derived from its keys.
    micro_batch_size: int = 1
    mini_batch_rows: int = 0  # rows per optimizer step; 0 = the whole batch
    epochs: int = _RL.epochs
    shuffle_mini_batch: bool = _RL.shuffle_mini_batch
    seed: int = MegatronConfig().seed
    clip_ratio: float = _RL.clip_ratio
    # rl_config.clip_ratio_low / clip_ratio_high with clip_higher_enable; None: clip_ratio on both sides.
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    kl_penalty: str = _RL.kl_penalty
    # Derived (a KL term iff GRPO's init_kl_coef is non-zero), as for the default config.
    use_kl: bool = True
    entropy_coeff: float = _RL.entropy_coeff
    token_level_loss: bool = _RL.token_level_loss
    # Truncation of the off-policy importance weight (rlfabric.importance_sampling_cap); only applied to an
    # Experience that carries behaviour log-probs (pipelined mode).
    is_cap: float = _FABRIC.importance_sampling_cap
    # verl's loss keys (rlfabric.policy_loss_mode, loss_agg_mode, loss_scale_factor, rollout_*); synchronous
    # without a correction, behaviour log-probs only measure the mismatch (options.loss_variant_from_config).
    variant: grpo_loss.LossVariant = grpo_loss.LossVariant(correction=rollout_correction.RolloutCorrection(None))
    # Versions a trained token may lag the actor (weight_version.staleness_bound of rlfabric.max_staleness and
    # rl_config.partial_rollout_max_split): the Update RPC's version fence.
    max_staleness: int = _FABRIC.max_staleness
    # use_remove_padding / use_dynamic_bsz with the update_* budgets (services/trainer/packing.py).
    packing: packing.Packing = packing.Packing(key_prefix="update")
    # PPO's critic only: the clipped value loss's range (rl_config.cliprange_value; services/trainer/value_loss.py).
    cliprange_value: float = _RL.cliprange_value


@dataclasses.dataclass
class Experience:
    """One global batch for the actor's Update: rows and their policy-loss inputs (packed like the rows' responses).

    Exactly one of `advantages` (one per sequence) and `token_advantages` (one per response token) is set."""

    rows: SequenceRows
    advantages: torch.Tensor | None  # float32 [B], or None with token_advantages
    old_log_probs: torch.Tensor | None  # float32 [sum(response_lengths)] or None (on-policy)
    ref_log_probs: torch.Tensor | None  # same, or None (no KL)
    # The rollout's log-probs of the samples (the behaviour policy), same layout; None when every sample is
    # on-policy (synchronous mode): then no importance weight is applied.
    behavior_log_probs: torch.Tensor | None = None
    # PPO's GAE advantages, float32 [sum(response_lengths)] like the log-probs; None with `advantages`.
    token_advantages: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.rows)
        for name in ("old_log_probs", "ref_log_probs", "behavior_log_probs", "token_advantages"):
            setattr(self, name, per_token(name, getattr(self, name), self.rows))
        if (self.advantages is None) == (self.token_advantages is None):
            raise ValueError("an actor update needs exactly one of advantages (one per sequence) and "
                             "token_advantages (one per response token)")
        if self.advantages is not None:
            self.advantages = torch.as_tensor(self.advantages, dtype=torch.float32).reshape(-1)
            if self.advantages.numel() != n:
                raise ValueError(f"advantages has {self.advantages.numel()} values for {n} sequences")

    def advantages_of(self, rows_idx: list[int], width: int) -> torch.Tensor:
        """The advantages of rows `rows_idx`: [b] per sequence, or [b, width] per token (right-padded)."""
        if self.token_advantages is None:
            return self.advantages[rows_idx]
        return response_slices(self.token_advantages, self.rows, rows_idx, width)


def per_token(name: str, values, rows: SequenceRows) -> torch.Tensor | None:
    """`values` as float32 [sum(response_lengths)] (None or empty: None); a ValueError naming `name` on a size
    that is not the rows' response-token count."""
    if values is None or torch.as_tensor(values).numel() == 0:
        return None
    v = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    if v.numel() != rows.num_response_tokens:
        raise ValueError(f"{name} has {v.numel()} values for {rows.num_response_tokens} response tokens")
    return v


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
    if opts.use_kl and exp.ref_log_probs is None:
        # A KL run (init_kl_coef != 0) that trained without its KL term would diverge silently from the config.
        raise ValueError("ref_log_probs is required: this trainer's loss has a KL term (rl_config.init_kl_coef != 0), "
                         "so every UpdateRequest must carry the reference model's log-probs")
    trained = optimize(model, optimizer, scheduler, exp.rows, opts, micro_batch_loss(exp, opts, temperature, kl_coef),
                       clip_grad, step)
    return actor_metrics(model, exp, opts, trained)


def actor_metrics(model, exp: Experience, opts: UpdateOptions, trained: Trained) -> dict[str, float]:
    """The actor's update metrics over the whole batch `exp` (collectives: every rank calls it)."""
    corrected = exp.behavior_log_probs is not None
    keys = ACTOR_LOSS_KEYS + (("actor/is_weight_mean", "actor/is_clipfrac")
                              if corrected and opts.variant.weights_tokens else ())
    metrics = reduce_mean_metrics(trained.mb_metrics, keys)
    metrics.update(step_means(trained.step_metrics, "grad_norm", "actor/lr"))
    if corrected:  # rollout_mismatch/*: token sums and a max over every rank (a collective: decided by the batch)
        # measured here only when the current weights are the rollout's (synchronous, old-log-prob pass skipped)
        same_weights = exp.old_log_probs is None and not opts.max_staleness
        metrics.update(rollout_correction.reduce_metrics(trained.mb_metrics, measured=same_weights))
    metrics.update(trained.tail_metrics(model, exp.rows))
    return metrics


@dataclasses.dataclass
class Trained:
    """What `optimize` saw: each micro-batch's loss metrics (this rank's, from the last pipeline stage of TP rank 0),
    each optimizer step's (grad norm, lr), and the MoE expert-load record of the pass."""

    mb_metrics: list[dict[str, float]]
    step_metrics: list[tuple[float, float]]
    load: moe.ExpertLoad | None
    real_micro_batches: int

    def tail_metrics(self, model, rows: SequenceRows) -> dict[str, float]:
        """The MoE and routing-replay metrics of the pass (collectives: every rank calls it)."""
        out: dict[str, float] = {}
        if self.load is not None:
            out.update(moe.moe_metrics(model, self.load, num_micro_batches=_mean_over_dp(self.real_micro_batches)))
        if rows.routed_experts is not None:
            out.update(routing_replay.take_metrics(model))
        return out


def optimize(model, optimizer, scheduler, rows: SequenceRows, opts: UpdateOptions, loss_fn, clip_grad: float,
             step: int) -> Trained:
    """`opts.epochs` passes over `rows` in mini-batches (one optimizer step each), each data-parallel rank running
    its share in micro-batches through `loss_fn` ((model output, micro-batch) -> (loss, metrics)): the update
    machinery the actor and PPO's critic share."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    trained = Trained([], [], moe.ExpertLoad(model) if moe.is_moe(model) else None, 0)
    lockstep = moe.lockstep_data_parallel(model)
    model.train()
    try:
        for epoch in range(opts.epochs):
            for mini in mini_batches(len(rows), opts, step, epoch):
                groups = packing.dp_groups(rows, mini, opts.micro_batch_size, opts.packing, dp=dp,
                                           dp_rank=dp_rank, same_count=lockstep)
                trained.real_micro_batches += sum(1 for g in groups if g)
                _step_mini_batch(model, optimizer, scheduler, rows, groups, opts, loss_fn, clip_grad, trained)
    finally:
        if trained.load is not None:
            trained.load.remove()
    return trained


def _step_mini_batch(model, optimizer, scheduler, rows: SequenceRows, groups: list[list[int]], opts: UpdateOptions,
                     loss_fn, clip_grad: float, trained: Trained) -> None:
    """One mini-batch: this rank's micro-batches `groups` forward and backward, then one optimizer step."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    share = sum(len(g) for g in groups)
    if share % opts.micro_batch_size and pp > 1 and not (opts.packing.dynamic or opts.packing.remove_padding):
        raise ValueError(
            f"{share} rows per data-parallel rank is not a multiple of micro_batch_size "
            f"{opts.micro_batch_size} (needed with pipeline parallelism)"
        )
    mbs = packing.build_micro_batches(rows, groups, opts.packing, pp=pp,
                                      tp=ps.get_tensor_model_parallel_world_size())
    for mb, scale in zip(mbs, packing.loss_scales(groups, opts.packing), strict=True):
        mb["loss_scale"] = scale
    optimizer.zero_grad()
    with moe.inert_padding(model, mbs):
        out = run_micro_batches(model, mbs, loss_fn, forward_only=False)
    finish_mini_batch(model, optimizer, scheduler, out, clip_grad, trained)


def finish_mini_batch(model, optimizer, scheduler, out: list[dict], clip_grad: float, trained: Trained) -> None:
    """After a mini-batch's forward and backward (`out`: its micro-batches' loss metrics): the optimizer step."""
    from megatron.core import parallel_state as ps

    update_expert_bias(model)  # DeepSeek-V3's aux-loss-free balancing, where Megatron's finalize_model_grads does it
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        trained.mb_metrics.extend(m for m in out if m)  # a padding micro-batch reports nothing
    lr = optimizer.param_groups[0]["lr"]
    norm = optimizer.step(clip_grad)
    if math.isfinite(norm):
        scheduler.step(increment=1)
    trained.step_metrics.append((norm, lr))


def _mean_over_dp(count: int) -> float:
    """The mean of `count` over the data-parallel ranks (a collective of the data-parallel group)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return float(count)
    t = torch.tensor([float(count)], dtype=torch.float64, device=moe.comm_device())
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item()) / dp


def micro_batch_loss(whole: Experience | None, opts: UpdateOptions, temperature: float, kl_coef: float):
    """The loss function Megatron's schedule calls per micro-batch: (logits, micro-batch) -> (loss, metrics); the
    rows' inputs come from `whole`, or from the micro-batch's own `experience`."""

    def loss_fn(logits: torch.Tensor, mb: dict):
        if mb.get("padding"):  # zero, but through the graph: its backward is a collective of the expert group
            return logits.sum() * 0.0, {}
        # A streaming update's micro-batch carries the rows that had arrived when it was built (streamed_update.py).
        exp = mb.get("experience", whole)
        logits = gather_response_logits(logits, mb)
        dev = logits.device
        tokens = mb["resp_tokens"].to(dev)
        logp, ent = grpo_loss.compute_log_probs(logits, tokens, temperature, with_entropy=opts.entropy_coeff != 0)
        if ent is None:
            ent = entropy_without_grad(logits, temperature)
        logp, ent = packing.unpack_response(logp, mb), packing.unpack_response(ent, mb)
        rows_idx = [i for i in mb["rows"] if i >= 0]
        width = logp.shape[1]
        mask = mb["response_mask"].to(dev)[: len(rows_idx)]
        logp, ent = logp[: len(rows_idx)], ent[: len(rows_idx)]
        old = None if exp.old_log_probs is None else response_slices(exp.old_log_probs, exp.rows, rows_idx, width)
        ref = None if exp.ref_log_probs is None else response_slices(exp.ref_log_probs, exp.rows, rows_idx, width)
        behavior = (None if exp.behavior_log_probs is None
                    else response_slices(exp.behavior_log_probs, exp.rows, rows_idx, width).to(dev))
        loss, metrics = grpo_loss.grpo_loss(
            logp,
            None if old is None else old.to(dev),
            None if ref is None else ref.to(dev),
            exp.advantages_of(rows_idx, width).to(dev),
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
            variant=opts.variant,
        )
        # use_dynamic_bsz: the micro-batch's weight in the mini-batch (packing.loss_scales); metrics stay unscaled.
        return loss * mb.get("loss_scale", 1.0), metrics

    return loss_fn


def reduce_mean_metrics(mb_metrics: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """Mean of every micro-batch's `keys` over all ranks that computed a loss (a collective of the whole group: every
    rank all-reduces the same shape, ranks without a loss contributing nothing)."""
    sums = torch.tensor([[sum(m[k] for m in mb_metrics) for k in keys] + [float(len(mb_metrics))]], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        sums = sums.to(dev)
        dist.all_reduce(sums)
        sums = sums.cpu()
    count = max(float(sums[0, -1]), 1.0)
    return {k: float(sums[0, i]) / count for i, k in enumerate(keys)}


def step_means(step_metrics: list[tuple[float, float]], norm_key: str, lr_key: str) -> dict[str, float]:
    """The mean gradient norm and learning rate of the optimizer steps (the same on every rank)."""
    n = max(len(step_metrics), 1)
    return {norm_key: sum(norm for norm, _ in step_metrics) / n, lr_key: sum(lr for _, lr in step_metrics) / n}
