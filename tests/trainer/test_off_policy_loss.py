"""The pipelined mode's truncated importance weight in the GRPO loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer import grpo_loss

LN = math.log


def _loss(logp, behavior, cap, old=None, adv=1.0):
    mask = torch.ones_like(logp)
    return grpo_loss.grpo_loss(logp, old, None, torch.tensor([adv]), mask, clip_ratio=0.2, use_kl=False,
                               behavior_log_probs=behavior, is_cap=cap)


def test_weights_truncate_at_the_cap_and_scale_the_surrogate_and_its_gradient() -> None:
    # proximal (= detached current, on-policy update) p = [0.5, 0.25], behaviour mu = [0.25, 0.5]:
    # raw weights p/mu = [2, 0.5]; cap 1.5 -> [1.5, 0.5]. Ratio 1, A = 1: pg_t = -w_t, token mean -1.0.
    logp = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    behavior = torch.tensor([[LN(0.25), LN(0.5)]], dtype=torch.float64)
    loss, metrics = _loss(logp, behavior, cap=1.5)
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["actor/is_weight_mean"] == pytest.approx(1.0)
    assert metrics["actor/is_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # d/dlogp_t of mean_t(-w_t * exp(logp_t - sg(logp_t))) = -w_t / 2; the weight itself carries no gradient.
    assert logp.grad[0].tolist() == pytest.approx([-0.75, -0.25])


def test_the_proximal_policy_is_the_old_log_probs_when_given() -> None:
    # old = [0.4], behaviour = [0.1] -> raw 4, cap 3 -> 3; current 0.4 too (ratio 1), A = -2: pg = 3 * 2 = 6.
    logp = torch.tensor([[LN(0.4)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = _loss(logp, torch.tensor([[LN(0.1)]], dtype=torch.float64), cap=3.0,
                          old=torch.tensor([[LN(0.4)]], dtype=torch.float64), adv=-2.0)
    assert loss.item() == pytest.approx(6.0)
    assert metrics["actor/is_clipfrac"] == 1.0


def test_behaviour_equal_to_proximal_changes_nothing_bit_for_bit() -> None:
    torch.manual_seed(0)
    logp = torch.randn(3, 5, dtype=torch.float32).log_softmax(-1)
    old = logp + 0.01 * torch.randn_like(logp)
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.ones_like(logp)
    base, _ = grpo_loss.grpo_loss(logp, old, None, adv, mask, clip_ratio=0.2, use_kl=False)
    same, m = grpo_loss.grpo_loss(logp, old, None, adv, mask, clip_ratio=0.2, use_kl=False,
                                  behavior_log_probs=old.clone(), is_cap=2.0)
    assert torch.equal(base, same)  # exp(0) * x == x exactly
    assert m["actor/is_weight_mean"] == 1.0


def test_without_behaviour_log_probs_no_importance_metrics_appear() -> None:
    logp = torch.zeros(1, 2)
    _, metrics = grpo_loss.grpo_loss(logp, None, None, torch.tensor([1.0]), torch.ones(1, 2), clip_ratio=0.2,
                                     use_kl=False)
    assert "actor/is_weight_mean" not in metrics


def test_a_non_positive_cap_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="importance_sampling_cap"):
        _loss(torch.zeros(1, 1), torch.zeros(1, 1), cap=0.0)
