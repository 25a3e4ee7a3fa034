"""Rollout correction: what the loss does about the rollout engine's log-probs differing from the trainer's.

The rollout samples with its own kernels and precision (bf16 vLLM against a Megatron trainer), and in pipelined
mode with weights one version old, so the behaviour policy mu that drew the tokens is not the policy pi_old the
PPO ratio starts from. As verl's `rollout_corr` defines it (verl/trainer/ppo/rollout_corr_helper.py, decoupled
mode), with d_t = log pi_old_t - log mu_t per response token (`rlfabric.rollout_*` keys):

- truncated importance sampling (TIS), `rollout_is`: the surrogate of each token is weighted, without gradient, by
  `token`: w_t = min(exp(clamp(d_t, -20, 20)), threshold), or `sequence`: every token of sample i by
  w_i = min(exp(clamp(sum_t d_t, -20, 20)), threshold) (`rollout_is_threshold`);
- rejection (masked importance sampling, MIS), `rollout_rs`: tokens, or whole samples, whose divergence passes a
  threshold leave the loss (the response mask loses them, so every term of the loss and its token count do).
  Each option is a level and an estimator of the divergence: `token_k*`, `seq_sum_k*`, `seq_mean_k*`,
  `seq_max_k*`, with k1 = -d (kept when log(lower) <= k1 <= log(upper), the ratio bounds `lower_upper` of
  `rollout_rs_threshold`, lower 1 / upper when omitted), k2 = d^2 / 2 and k3 = exp(d) - 1 - d (kept when <= the
  threshold), d clamped to [-20, 20]; several options, comma-separated, must all pass (parsed by
  services/common/config/loss_variants.py `parse_rs`).

pi_old is the old-log-prob pass's, or, when that pass is skipped (one optimizer step per iteration, so the
trainer's current log-probs are the old ones), the trainer's own current log-probs, detached.
tests/trainer/test_loss_verl.py checks weights, masks and the loss against verl's functions (float64, max
difference 0).

Metrics: `actor/is_weight_mean` and `actor/is_clipfrac` (with IS), `rollout_mismatch/masked_fraction` (the share
of response tokens rejection removed, 0 without it), and, when pi_old is the current policy at the rollout's weights
(synchronous, old-log-prob pass skipped), the mismatch itself (`rollout_mismatch/{mean_abs_logp_diff,kl,max_ratio}`,
as services/coordinator/off_policy.py defines them from that pass when it runs); the
token-weighted ones travel as sums (`SUM_PREFIX`) and the max as `MAX_PREFIX`, finished by `reduce_metrics`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from services.common.config.loss_variants import IS_LEVELS, RsOption
from services.trainer.loss_agg import masked_mean

SAFETY_BOUND = 20.0  # |d| is clamped here before exp: exp(20) ~ 4.9e8 stays finite in every float type
SUM_PREFIX, MAX_PREFIX = "sum:", "max:"
_COUNT = SUM_PREFIX + "tokens"


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The correction the loss applies when behaviour log-probs come with the batch.

    `is_level` None: no importance weight; `rs` empty: no rejection.
    """

    is_level: str | None = "token"
    is_threshold: float = 2.0
    rs: tuple[RsOption, ...] = ()


def _row_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=-1)


def importance_weights(log_ratio: Tensor, mask: Tensor, level: str, threshold: float) -> tuple[Tensor, dict[str, float]]:
    """Truncated IS weights `[batch, seq]` (zero on padding, no gradient) and their metrics."""
    if level not in IS_LEVELS:
        raise ValueError(f"rlfabric.rollout_is must be one of {IS_LEVELS}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"the importance weight truncation must be > 0, got {threshold} "
                         "(rlfabric.rollout_is_threshold, or rlfabric.importance_sampling_cap in pipelined mode)")
    with torch.no_grad():
        if level == "token":
            raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        else:
            total = _row_sum(log_ratio, mask).unsqueeze(-1)
            raw = torch.exp(torch.clamp(total, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
        raw = raw * mask
        weights = raw.clamp(max=threshold)
        metrics = {"actor/is_weight_mean": masked_mean(weights, mask).item(),
                   "actor/is_clipfrac": masked_mean((raw > threshold).to(weights.dtype), mask).item()}
    return weights, metrics


def _statistic(option: RsOption, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """The option's divergence statistic, per token `[batch, seq]` or per sequence `[batch, 1]`."""
    d = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    k = option.name[-2:]
    per_token = -d if k == "k1" else 0.5 * d**2 if k == "k2" else torch.exp(d) - 1.0 - d
    if option.name.startswith("token_"):
        return per_token
    if option.name.startswith("seq_sum_"):
        return _row_sum(per_token, mask).unsqueeze(-1)
    if option.name.startswith("seq_mean_"):
        return (_row_sum(per_token, mask) / (mask.sum(dim=-1) + 1e-8)).unsqueeze(-1)
    peak = per_token.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(peak == float("-inf"), torch.zeros_like(peak), peak).unsqueeze(-1)


def rejection_mask(log_ratio: Tensor, mask: Tensor, options: tuple[RsOption, ...]) -> Tensor:
    """The response mask without the tokens (or sequences) that fail any option, in the mask's dtype."""
    keep = torch.ones_like(log_ratio)
    with torch.no_grad():
        for option in options:
            stat = _statistic(option, log_ratio, mask)
            ok = stat <= option.upper if option.lower is None else (stat >= option.lower) & (stat <= option.upper)
            keep = keep * ok.expand_as(log_ratio).to(log_ratio.dtype)
    return (mask * keep).to(mask.dtype)


def correct(proximal_log_probs: Tensor, behavior_log_probs: Tensor, mask: Tensor, corr: RolloutCorrection,
            *, proximal_is_current: bool = False) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """`(weights or None, the response mask after rejection, metrics)` for one micro-batch (see module docstring).

    `proximal_is_current`: pi_old is the trainer's current policy (old-log-prob pass skipped), so the mismatch
    metrics are measured here too.
    """
    with torch.no_grad():
        log_ratio = proximal_log_probs.detach() - behavior_log_probs
        metrics: dict[str, float] = {}
        weights = None
        if corr.is_level is not None:
            weights, metrics = importance_weights(log_ratio, mask, corr.is_level, corr.is_threshold)
        kept = rejection_mask(log_ratio, mask, corr.rs) if corr.rs else mask
        m = mask.to(log_ratio.dtype)
        metrics[_COUNT] = m.sum().item()
        metrics[SUM_PREFIX + "rollout_mismatch/masked_fraction"] = (m - kept.to(m.dtype)).sum().item()
        if proximal_is_current:
            d = log_ratio.double()
            metrics[SUM_PREFIX + "rollout_mismatch/mean_abs_logp_diff"] = (d.abs() * m).sum().item()
            metrics[SUM_PREFIX + "rollout_mismatch/kl"] = ((torch.expm1(d) - d) * m).sum().item()
            top = d.masked_fill(~mask.bool(), float("-inf")).max().item() if m.sum() > 0 else float("-inf")
            metrics[MAX_PREFIX + "rollout_mismatch/max_ratio"] = top
    return weights, kept, metrics


def split_metrics(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(plain metrics, the raw sums and maxes `reduce_metrics` finishes)."""
    raw = {k: v for k, v in metrics.items() if k.startswith((SUM_PREFIX, MAX_PREFIX))}
    return {k: v for k, v in metrics.items() if k not in raw}, raw


def reduce_metrics(raw: list[dict[str, float]], *, measured: bool) -> dict[str, float]:
    """The rollout_mismatch/* metrics of one update over every micro-batch of every rank (a collective of the
    world group; every rank calls it, with `measured` the same everywhere: whether the mismatch was measured).

    Token-weighted means are sums over all tokens divided by their count; max_ratio is exp(max d).
    """
    import torch.distributed as dist

    sum_keys = ["rollout_mismatch/masked_fraction"]
    if measured:
        sum_keys += ["rollout_mismatch/mean_abs_logp_diff", "rollout_mismatch/kl"]
    sums = torch.tensor([[sum(m.get(SUM_PREFIX + k, 0.0) for m in raw) for k in sum_keys]
                         + [sum(m.get(_COUNT, 0.0) for m in raw)]], dtype=torch.float64)
    top = torch.tensor([max((m.get(MAX_PREFIX + "rollout_mismatch/max_ratio", -math.inf) for m in raw),
                            default=-math.inf)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        sums, top = sums.to(dev), top.to(dev)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        sums, top = sums.cpu(), top.cpu()
    count = max(float(sums[0, -1]), 1.0)
    out = {k: float(sums[0, i]) / count for i, k in enumerate(sum_keys)}
    if measured:
        out["rollout_mismatch/max_ratio"] = math.exp(float(top[0])) if math.isfinite(float(top[0])) else 0.0
    return out
