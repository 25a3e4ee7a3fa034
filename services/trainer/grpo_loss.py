"""The GRPO / DAPO actor loss: pure tensor functions, no model, no I/O, no parallel state.

This module owns the math of one actor update step on one micro-batch. The trainer's update loop
calls it; everything about batching, Megatron and gradients lives there.

Formulas (per response token t of sample i; `A_i` is the group-normalised advantage from
`services/coordinator/advantages.py`, broadcast over the sample's response tokens, or with PPO's GAE a per-token
`A_t`, `UpdateRequest.token_advantages`: then, with no KL term and token-mean, this is MindSpeed-RL's PPO actor loss,
`PPOActorLossFunc._compute_ppo_policy_loss`, tests/trainer/test_ppo_actor_loss.py)::

    log p_t   = log_softmax(logits_t / temperature)[token_t]        compute_log_probs
    ratio_t   = exp(log p_t - log p_old_t)
    pg_t      = max(-A_i * ratio_t, -A_i * clip(ratio_t, 1 - eps_low, 1 + eps_high))   policy_loss
    d_t       = log p_ref_t - log p_t
    kl_t      = clamp(exp(clamp(d_t, -20, 20)) - clamp(d_t, -20, 20) - 1, -10, 10)     low_var_kl (k3)
              | log p_t - log p_ref_t                                                   kl  (k1)
              | |log p_t - log p_ref_t|                                                 abs
              | 0.5 * (log p_t - log p_ref_t)^2                                         mse (k2)
    loss      = agg(pg) + kl_coef * token_mean(kl) - entropy_coeff * token_mean(entropy)

GSPO (`rlfabric.policy_loss_mode: gspo`, https://arxiv.org/abs/2507.18071, as verl's `compute_policy_loss_gspo`)
replaces the token ratio by the sequence's geometric-mean ratio, carrying each token's own gradient::

    s_i       = exp(token_mean_i(log p - log p_old))
    ratio_t   = exp(min(sg(log s_i) + log p_t - sg(log p_t), 10))                      (then clipped as above)

and always aggregates "seq-mean-token-mean".

Samples may carry the behaviour policy's log-probs `log mu_t` (what the rollout engine sampled with: pipelined
mode, `rlfabric.max_staleness` >= 1, or any mode with a `rlfabric.rollout_*` correction); the surrogate is then
weighted by the truncated importance ratio between the proximal (old) policy and the behaviour one, and tokens
or sequences past a divergence threshold leave the loss (services/trainer/rollout_correction.py)::

    w_t       = min(exp(log p_old_t - log mu_t), threshold)        (no gradient; per token or per sequence)
    pg_t      = w_t * max(-A_i * ratio_t, -A_i * clip(ratio_t, ...))

This is the decoupled PPO objective of asynchronous RL (Hilton et al., "Batch size-invariance for policy
optimization", https://arxiv.org/abs/2110.00641; truncated IS as in IMPALA/V-trace,
https://arxiv.org/abs/1802.01561): the PPO clip keeps the step near the proximal policy, the truncated weight
corrects for the samples coming from another one without letting a single token's ratio explode. Without
behaviour log-probs w_t is not applied at all, so the synchronous loss is unchanged bit for bit.

`agg` (LOSS_AGG_MODES, verl's names) is "token-mean" (mean over every response token of the micro-batch; YAML
`rl_config.token_level_loss: true`, the default), "seq-mean-token-mean" (mean over each sample's tokens, then
over the samples that have any; `token_level_loss: false`), or with `rlfabric.loss_agg_mode` also
"seq-mean-token-sum" (each sample's token sum, mean over samples) and "seq-mean-token-sum-norm" (the sum over
every token / `loss_scale_factor`, the longest response; Dr.GRPO). As in MindSpeed-RL, the aggregation mode
applies to the policy-gradient term only; the KL and entropy terms are always token means.

Papers: GRPO, DeepSeekMath https://arxiv.org/abs/2402.03300 (group advantages, KL in the loss with
the k3 estimator); DAPO https://arxiv.org/abs/2503.14476 (clip-higher, token-level loss, no KL,
dynamic sampling, overlong shaping); k1/k2/k3 from J. Schulman, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html.

Which YAML key selects which variant (MindSpeed-RL `rl_config`):
    clip_ratio                                  eps_low = eps_high = clip_ratio
    clip_higher_enable, clip_ratio_low/_high    eps_low, eps_high (DAPO clip-higher)
    kl_penalty                                  low_var_kl | kl | abs | mse  (see KL_PENALTIES)
    init_kl_coef (through the KL controller)    kl_coef; DAPO runs pass use_kl=False
    entropy_coeff                               entropy bonus weight (entropy only needed if != 0)
    token_level_loss                            token-mean vs seq-mean-token-mean (LOSS_AGG_MODES)
    rlfabric.policy_loss_mode, loss_agg_mode,   verl's keys: vanilla | gspo; any of LOSS_AGG_MODES (`LossVariant`)
      loss_scale_factor, rollout_*

Contract with the caller (the trainer's update loop):
- All per-token tensors are `[batch, seq]` over the response tokens only, aligned so that
  `log_probs[:, t]` is the log-probability of the t-th response token; `response_mask[:, t]` is 1
  on real response tokens and 0 on padding. `advantages` is `[batch, seq]` or `[batch]`.
- `grpo_loss` returns the loss of ONE micro-batch (a mean over that micro-batch). The caller
  averages micro-batch losses over the mini-batch, e.g. backward on `loss / num_micro_batches`,
  and averages the metrics the same way; that reproduces MindSpeed-RL's "token mean per
  micro-batch, averaged over the mini-batch".
- Old log-probs may be None when the update is fully on-policy (the config's
  `derived.skip_old_log_probs`): the ratio is then exp(log p - detach(log p)) == 1 with the correct gradient.
- With tensor parallelism the logits are vocab-sharded; `compute_log_probs` expects full-vocab
  logits, so a TP trainer gathers them first or applies the same formula with all-reduces.

Metrics are floats (detached): `actor/pg_loss` (the aggregated clipped surrogate, signed),
`actor/pg_clipfrac`, `actor/ppo_kl` (token mean of old - new), `actor/kl_loss` (token mean of
the KL penalty, before kl_coef), `actor/entropy`, and `actor/loss` (the total). Note that
MindSpeed-RL logs `abs(total loss)` under `actor/pg_loss`; `abs(actor/loss)` gives that number. With behaviour
log-probs also the rollout correction's (services/trainer/rollout_correction.py), some as raw sums for the update.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from services.common import kl as kl_estimators
from services.common.config.loss_variants import POLICY_LOSS_MODES
from services.common.kl import KL_PENALTIES, kl_penalty  # re-exported: the loss's estimators (one home)
from services.trainer.loss_agg import LOSS_AGG_MODES, aggregate_loss, masked_mean
from services.trainer.rollout_correction import RolloutCorrection, correct

__all__ = ["LOSS_AGG_MODES", "KL_PENALTIES", "LossVariant", "aggregate_loss", "compute_log_probs", "grpo_loss",
           "kl_penalty", "masked_mean", "policy_loss"]

_GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of the sequence log-ratio before exp


@dataclasses.dataclass(frozen=True)
class LossVariant:
    """The loss keys verl has and MindSpeed-RL lacks (`rlfabric.*`); the defaults are the MindSpeed-RL loss.

    Attributes:
        policy_loss_mode: "vanilla" (the clipped token ratio) or "gspo" (the sequence ratio).
        loss_agg_mode: a key of LOSS_AGG_MODES, or None for `token_level_loss`'s choice.
        loss_scale_factor: the divisor of "seq-mean-token-sum-norm" (None: the micro-batch's padded width).
        correction: the rollout correction for batches with behaviour log-probs; None: token-level truncation at
            `is_cap` (pipelined mode's default).
    """

    policy_loss_mode: str = "vanilla"
    loss_agg_mode: str | None = None
    loss_scale_factor: float | None = None
    correction: RolloutCorrection | None = None

    @property
    def weights_tokens(self) -> bool:
        """Whether a batch with behaviour log-probs gets importance weights (and their actor/is_* metrics)."""
        return self.correction is None or self.correction.is_level is not None


def compute_log_probs(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, *, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of `token_ids` (and optionally the entropy) under `logits / temperature`.

    Dividing by the sampling temperature makes these the log-probs of the distribution vLLM
    actually sampled from, which is what the importance ratio needs.

    Args:
        logits: `[batch, seq, vocab]`, full vocabulary, already shifted so that `logits[:, t]`
            predicts `token_ids[:, t]`. Half-precision logits are upcast to float32.
        token_ids: `[batch, seq]` int64.
        temperature: the rollout's `sampling_config.temperature`; must be > 0.
        with_entropy: also return the entropy of each position's distribution.

    Returns:
        `(log_probs [batch, seq], entropy [batch, seq] or None)`.
    """
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 to compute log-probs, got {temperature}; "
            "set generate_config.sampling_config.temperature to a positive value"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    scaled = logits / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)  # [batch, seq]
    picked = scaled.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)  # [batch, seq]
    log_probs = picked - log_norm
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * z_v, with p = softmax(z): one pass, no log of small p_v.
        probs = torch.softmax(scaled, dim=-1)
        entropy = log_norm - (probs * scaled).sum(dim=-1)
    return log_probs, entropy


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    is_weights: Tensor | None = None,
    mode: str = "vanilla",
) -> tuple[Tensor, dict[str, float]]:
    """Per-token clipped surrogate loss of PPO/GRPO with asymmetric clipping (DAPO clip-higher), or GSPO's.

    Args:
        log_probs: `[batch, seq]` current policy, with gradient.
        old_log_probs: `[batch, seq]` policy that generated the samples; None when on-policy.
        advantages: `[batch, seq]` or `[batch]` (broadcast over tokens).
        response_mask: `[batch, seq]`.
        clip_ratio_low: the ratio is clipped below at 1 - clip_ratio_low.
        clip_ratio_high: the ratio is clipped above at 1 + clip_ratio_high.
        is_weights: `[batch, seq]` importance weights of the rollout correction (no gradient), or None.
        mode: a value of POLICY_LOSS_MODES; "gspo" uses the sequence ratio (module docstring).

    Returns:
        `(per_token_loss [batch, seq], metrics)`; padding positions hold values that the caller
        masks out in `aggregate_loss`. Metrics: `actor/pg_clipfrac` (share of response tokens
        where the clipped term is the larger one) and `actor/ppo_kl` (token mean of old - new).
    """
    if mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unsupported rlfabric.policy_loss_mode {mode!r}; supported: {list(POLICY_LOSS_MODES)}")
    if old_log_probs is None:
        old_log_probs = log_probs.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = log_probs - old_log_probs
    if mode == "gspo":
        # log s_i is the sequence's mean log-ratio; log p - sg(log p) is 0 in value and carries the token's gradient
        seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
        token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
        ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_LOG_RATIO_MAX))
    else:
        ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((clipped > unclipped).to(log_probs.dtype), response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    if is_weights is not None:
        per_token = per_token * is_weights
    return per_token, metrics


def _checked_clip_bounds(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None, entropy_coeff: float,
    entropy: Tensor | None,
) -> tuple[float, float]:
    """grpo_loss's argument checks; returns the (low, high) clip bounds."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if low < 0 or high < 0:
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={low}, clip_ratio_high={high} "
            "(rl_config.clip_ratio / clip_ratio_low / clip_ratio_high)"
        )
    if entropy_coeff != 0 and entropy is None:
        raise ValueError(
            f"entropy_coeff={entropy_coeff} needs the per-token entropy: "
            "call compute_log_probs(..., with_entropy=True) and pass entropy="
        )
    return low, high


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor | None,
    ref_log_probs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio: float,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    kl_penalty: str = "low_var_kl",  # spelled as the YAML key, so it shadows the function here
    kl_coef: float = 0.001,
    use_kl: bool = True,
    entropy_coeff: float = 0.0,
    entropy: Tensor | None = None,
    token_level_loss: bool = True,
    behavior_log_probs: Tensor | None = None, is_cap: float = 2.0,
    variant: LossVariant | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO (or DAPO) actor loss of one micro-batch.

    Args:
        log_probs: `[batch, seq]` current policy, with gradient (`compute_log_probs`).
        old_log_probs: `[batch, seq]` behaviour policy, or None when on-policy (ratio == 1).
        ref_log_probs: `[batch, seq]` reference policy; required when `use_kl`.
        advantages: `[batch, seq]` or `[batch]`.
        response_mask: `[batch, seq]`, 1 on response tokens.
        clip_ratio: symmetric clip range; used for a side whose own ratio is None.
        clip_ratio_low, clip_ratio_high: DAPO clip-higher bounds (YAML keys of the same names,
            active with `clip_higher_enable`).
        kl_penalty: KL estimator, a key of `KL_PENALTIES`.
        kl_coef: weight of the KL term (the KL controller's current value).
        use_kl: False for DAPO (no reference model, no KL term).
        entropy_coeff: weight of the entropy bonus (subtracted from the loss).
        entropy: `[batch, seq]` per-token entropy with gradient (`compute_log_probs(..., with_entropy=True)`);
            required when `entropy_coeff != 0`, else it only feeds `actor/entropy` (0.0 when absent).
        token_level_loss: True for "token-mean", False for "seq-mean-token-mean" on the pg term.
        behavior_log_probs: `[batch, seq]` the rollout's log-probs; None: no rollout correction.
        is_cap: the token-level truncation when `variant.correction` is None (pipelined mode's default).
        variant: the verl loss keys (`LossVariant`); None: the MindSpeed-RL loss.

    Returns:
        `(loss, metrics)`: a 0-dim tensor to backpropagate (one micro-batch's mean; see the
        module docstring for the mini-batch contract) and detached float metrics.
    """
    low, high = _checked_clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high, entropy_coeff, entropy)
    variant = variant or LossVariant()
    weights, correction_metrics = None, {}
    if behavior_log_probs is not None:
        proximal = log_probs.detach() if old_log_probs is None else old_log_probs
        weights, response_mask, correction_metrics = correct(
            proximal, behavior_log_probs, response_mask,
            variant.correction or RolloutCorrection("token", is_cap), proximal_is_current=old_log_probs is None)
    per_token_pg, metrics = policy_loss(
        log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=low, clip_ratio_high=high,
        is_weights=weights, mode=variant.policy_loss_mode,
    )
    metrics.update(correction_metrics)
    pg = aggregate_loss(per_token_pg, response_mask, _agg_mode(variant, token_level_loss), variant.loss_scale_factor)
    loss = pg

    if use_kl:
        if ref_log_probs is None:
            raise ValueError(
                "use_kl=True needs ref_log_probs (the reference model's log-probs); "
                "pass them, or set use_kl=False for a run without KL (DAPO)"
            )
        kl = masked_mean(kl_estimators.kl_penalty(log_probs, ref_log_probs, kl_penalty), response_mask)
        loss = loss + kl_coef * kl
        kl_value = kl.item()
    else:
        kl_value = 0.0

    entropy_value = 0.0
    if entropy is not None:
        mean_entropy = masked_mean(entropy, response_mask)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * mean_entropy
        entropy_value = mean_entropy.item()

    metrics.update({"actor/pg_loss": pg.item(), "actor/kl_loss": kl_value, "actor/entropy": entropy_value,
                    "actor/loss": loss.item()})
    return loss, metrics


def _agg_mode(variant: LossVariant, token_level_loss: bool) -> str:
    """GSPO aggregates per sequence whatever is configured (as verl); else loss_agg_mode, else token_level_loss."""
    if variant.policy_loss_mode == "gspo":
        return "seq-mean-token-mean"
    if variant.loss_agg_mode is not None:
        return variant.loss_agg_mode
    return "token-mean" if token_level_loss else "seq-mean-token-mean"
