"""The rollout correction (TIS, MIS) and the verl loss variants (GSPO, the token-sum aggregations), worked by hand.

tests/trainer/test_loss_verl.py checks the same functions against verl's on random inputs; here each number is
written out, including what the synchronous on-policy update (old-log-prob pass skipped) measures and logs.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config.loss_variants import parse_rs
from services.trainer.grpo_loss import LossVariant, aggregate_loss, grpo_loss, policy_loss
from services.trainer.rollout_correction import RolloutCorrection, correct, reduce_metrics, split_metrics

LN = math.log
DT = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=DT)


def test_sequence_level_weight_is_the_truncated_product_of_the_token_ratios() -> None:
    # row 0: ratios 2 and 1.5 -> product 3 -> truncated at 2.5 on both tokens; row 1: 0.5 alone -> 0.5
    proximal = t([[LN(0.4), LN(0.3)], [LN(0.1), 0.0]])
    behavior = t([[LN(0.2), LN(0.2)], [LN(0.2), 0.0]])
    mask = t([[1, 1], [1, 0]])
    weights, kept, metrics = correct(proximal, behavior, mask, RolloutCorrection("sequence", 2.5))
    assert weights.flatten().tolist() == pytest.approx([2.5, 2.5, 0.5, 0.0])
    assert torch.equal(kept, mask)
    assert metrics["actor/is_clipfrac"] == pytest.approx(2 / 3)  # two of three tokens truncated
    assert metrics["actor/is_weight_mean"] == pytest.approx((2.5 + 2.5 + 0.5) / 3)


def test_token_k1_rejection_keeps_ratios_within_the_bounds() -> None:
    # ratios p_old / p_rollout = [2, 1, 0.25]; "0.5_3" keeps log(0.5) <= log(rollout / old) <= log(3),
    # i.e. 1/3 <= ratio <= 2: the first two stay, the third (0.25) leaves.
    proximal, behavior = t([[LN(0.4), LN(0.2), LN(0.05)]]), t([[LN(0.2), LN(0.2), LN(0.2)]])
    mask = torch.ones(1, 3, dtype=DT)
    weights, kept, metrics = correct(proximal, behavior, mask, RolloutCorrection(None, 2.0, parse_rs("token_k1", "0.5_3")))
    assert weights is None and "actor/is_weight_mean" not in metrics
    assert kept.tolist() == [[1.0, 1.0, 0.0]]
    assert metrics["sum:rollout_mismatch/masked_fraction"] == 1.0 and metrics["sum:tokens"] == 3.0


def test_sequence_rejection_removes_the_sample_from_every_term_of_the_loss() -> None:
    # Two samples, advantages +1 and -1, on-policy (ratio 1, pg_t = -A). Sample 1's rollout log-probs are far
    # off (k2 = 0.5 * 2^2 = 2 > 0.5 at its max token): seq_max_k2 drops it, so the loss is sample 0's alone: -1.
    logp = t([[LN(0.5), LN(0.5)], [LN(0.5), LN(0.5)]]).requires_grad_(True)
    behavior = t([[LN(0.5), LN(0.5)], [LN(0.5) - 2.0, LN(0.5)]])
    ref = logp.detach() - 0.3  # a KL term over the kept tokens only
    variant = LossVariant(correction=RolloutCorrection(None, 2.0, parse_rs("seq_max_k2", 0.5)),
                          loss_agg_mode="seq-mean-token-mean")
    loss, metrics = grpo_loss(logp, None, ref, t([1.0, -1.0]), torch.ones(2, 2, dtype=DT), clip_ratio=0.2,
                              kl_penalty="kl", kl_coef=1.0, behavior_log_probs=behavior, variant=variant)
    assert metrics["actor/pg_loss"] == pytest.approx(-1.0)
    assert metrics["actor/kl_loss"] == pytest.approx(0.3)
    assert loss.item() == pytest.approx(-0.7)
    loss.backward()
    assert logp.grad[1].tolist() == [0.0, 0.0]  # the rejected sample gets no gradient at all
    assert metrics["sum:rollout_mismatch/masked_fraction"] == 2.0


def test_synchronous_on_policy_update_measures_the_mismatch_against_its_current_log_probs() -> None:
    # old log-probs skipped: the current policy is pi_old. d = current - rollout = [ln 2, 0, -ln 2] on 3 tokens.
    logp = t([[LN(0.4), LN(0.2), LN(0.1)]]).requires_grad_(True)
    behavior = t([[LN(0.2), LN(0.2), LN(0.2)]])
    variant = LossVariant(correction=RolloutCorrection("token", 1.5))
    _, metrics = grpo_loss(logp, None, None, t([1.0]), torch.ones(1, 3, dtype=DT), clip_ratio=0.2, use_kl=False,
                           behavior_log_probs=behavior, variant=variant)
    plain, raw = split_metrics(metrics)
    assert plain["actor/is_weight_mean"] == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    out = reduce_metrics([raw, raw], measured=True)  # two micro-batches alike: the same token means
    assert out["rollout_mismatch/mean_abs_logp_diff"] == pytest.approx(2 * LN(2) / 3)
    # k3 = exp(d) - 1 - d: (1 - ln 2) + 0 + (-0.5 + ln 2) = 0.5 over 3 tokens
    assert out["rollout_mismatch/kl"] == pytest.approx(0.5 / 3)
    assert out["rollout_mismatch/max_ratio"] == pytest.approx(2.0)
    assert out["rollout_mismatch/masked_fraction"] == 0.0


def test_without_a_correction_the_rollouts_log_probs_only_measure() -> None:
    # plain synchronous mode (RolloutCorrection(None)): same loss and gradient as without them, mismatch logged
    def run(behavior):
        logp = t([[LN(0.4), LN(0.2), LN(0.1)], [LN(0.5), LN(0.3), 0.0]]).requires_grad_(True)
        loss, metrics = grpo_loss(logp, None, None, t([1.0, -0.5]), t([[1, 1, 1], [1, 1, 0]]), clip_ratio=0.2,
                                  use_kl=False, behavior_log_probs=behavior,
                                  variant=LossVariant(correction=RolloutCorrection(None)))
        loss.backward()
        return loss.item(), logp.grad.tolist(), metrics

    loss, grad, metrics = run(t([[LN(0.2)] * 3, [LN(0.5), LN(0.6), -5.0]]))
    assert (loss, grad) == run(None)[:2]
    plain, raw = split_metrics(metrics)
    assert not any(k.startswith("actor/is_") for k in plain)
    out = reduce_metrics([raw], measured=True)
    # d = [ln 2, 0, -ln 2] and [0, -ln 2] on 5 tokens (the padded third token of row 2 not counted)
    assert out["rollout_mismatch/mean_abs_logp_diff"] == pytest.approx(3 * LN(2) / 5)
    assert out["rollout_mismatch/max_ratio"] == pytest.approx(2.0)
    assert out["rollout_mismatch/masked_fraction"] == 0.0


def test_with_old_log_probs_the_mismatch_is_left_to_the_coordinator() -> None:
    logp = t([[LN(0.4)]])
    _, _, metrics = correct(logp, t([[LN(0.2)]]), torch.ones(1, 1, dtype=DT), RolloutCorrection("token", 2.0))
    assert not any("mean_abs_logp_diff" in k for k in metrics)
    assert set(reduce_metrics([metrics], measured=False)) == {"rollout_mismatch/masked_fraction"}


def test_pipelined_default_is_token_truncation_at_the_cap() -> None:
    # No correction configured: behaviour log-probs (pipelined mode) get w = min(p_old / mu, is_cap) per token.
    logp = t([[LN(0.5), LN(0.25)]]).requires_grad_(True)
    behavior = t([[LN(0.25), LN(0.5)]])
    loss, metrics = grpo_loss(logp, None, None, t([1.0]), torch.ones(1, 2, dtype=DT), clip_ratio=0.2, use_kl=False,
                              behavior_log_probs=behavior, is_cap=1.5)
    assert loss.item() == pytest.approx(-1.0) and metrics["actor/is_clipfrac"] == 0.5
    assert LossVariant().weights_tokens and not LossVariant(correction=RolloutCorrection(None)).weights_tokens


def test_gspo_ratio_is_the_sequences_geometric_mean_with_each_tokens_gradient() -> None:
    # log(p / p_old) = [0.1, -0.3] -> s = exp(-0.1) on both tokens; A = 1, clip 0.2: exp(-0.1) = 0.905 in range.
    old = t([[LN(0.5), LN(0.5)]])
    logp = (old + t([[0.1, -0.3]])).requires_grad_(True)
    per_token, metrics = policy_loss(logp, old, t([1.0]), torch.ones(1, 2, dtype=DT), clip_ratio_low=0.2,
                                     clip_ratio_high=0.2, mode="gspo")
    assert per_token[0].tolist() == pytest.approx([-math.exp(-0.1)] * 2)
    per_token.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(-0.1)] * 2)  # d s_t / d log p_t = s
    assert metrics["actor/ppo_kl"] == pytest.approx(0.1)


def test_gspo_always_aggregates_per_sequence() -> None:
    logp = t([[LN(0.5), LN(0.5), LN(0.5)], [LN(0.5), 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    variant = LossVariant(policy_loss_mode="gspo", loss_agg_mode="token-mean")  # token-mean is overridden
    loss, _ = grpo_loss(logp, None, None, t([1.0, -3.0]), mask, clip_ratio=0.2, use_kl=False, variant=variant)
    assert loss.item() == pytest.approx((-1.0 + 3.0) / 2)  # each sample weighs one half, not 3/4 and 1/4


def test_token_sum_aggregations() -> None:
    per_token = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == 5.0  # (6 + 4) / 2
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 3)  # width 3
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", 8.0).item() == 1.25  # Dr.GRPO: / max_tokens


@pytest.mark.parametrize(("rs", "threshold", "match"), [
    ("token_k4", 1.0, "unknown option"), ("seq_max_k1", 1.0, "unknown option"),
    ("token_k2", None, "needs rlfabric.rollout_rs_threshold"), ("token_k2,token_k3", "1,2,3", "3 thresholds"),
    ("token_k1", "0_2", "not a positive threshold"), ("token_k2", "0.5_1", "not a positive threshold"),
    ("token_k3", -1.0, "not a positive threshold"),
])
def test_rejection_specs_that_verl_refuses_are_refused(rs, threshold, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rs(rs, threshold)


def test_rejection_specs_parse_as_verl_reads_them() -> None:
    a, b = parse_rs("token_k1, seq_mean_k3", "0.5_2.0,0.1")
    assert (a.name, a.lower, a.upper) == ("token_k1", pytest.approx(LN(0.5)), pytest.approx(LN(2.0)))
    assert (b.name, b.lower, b.upper) == ("seq_mean_k3", None, 0.1)
    (c,) = parse_rs("seq_sum_k1", 4)  # k1 with one bound: 1/4 .. 4
    assert (c.lower, c.upper) == (pytest.approx(-LN(4)), pytest.approx(LN(4)))
