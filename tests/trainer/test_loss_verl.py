"""GSPO, the loss aggregation modes (Dr.GRPO's seq-mean-token-sum-norm among them) and the rollout correction
(TIS at token and sequence level, rejection by the k1/k2/k3 criteria) against verl's own functions.

tests/trainer/verl_losses.json holds fixed float64 log-probs (current, old, rollout), masks and advantages and what
verl's `compute_rollout_correction_weights`, `compute_rollout_rejection_mask` and `compute_policy_loss_vanilla` /
`compute_policy_loss_gspo` returned for them: the weights, the mask after rejection, the loss and its gradient
with respect to the current log-probs (made by tests/verl_expected.py from a verl checkout, stored exactly).
Weights, masks, loss and gradient must be equal (maximum difference 0). verl's vanilla loss also has dual-clip
(ratio capped at 3 for negative advantages) which MindSpeed-RL's loss has not; these inputs keep every ratio
below 3, where the two are the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config.loss_variants import parse_rs
from services.trainer.grpo_loss import LossVariant, grpo_loss
from services.trainer.rollout_correction import SUM_PREFIX, RolloutCorrection, correct
from tests.verl_expected import unhex

torch.set_num_threads(1)
FIXTURE = json.loads((Path(__file__).parent / "verl_losses.json").read_text())
CASES = FIXTURE["cases"]


def tensors(case: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(unhex(v)) for k, v in case["inputs"].items()}


def correction_of(case: dict) -> RolloutCorrection | None:
    if case["rollout_is"] is None and case["rollout_rs"] is None:
        return None
    return RolloutCorrection(case["rollout_is"], case["rollout_is_threshold"] or 2.0,
                             parse_rs(case["rollout_rs"], case["rollout_rs_threshold"]))


def run_ours(case: dict):
    x = tensors(case)
    logp = x["log_probs"].clone().requires_grad_(True)
    corr = correction_of(case)
    clip, low, high = case["clip"]
    variant = LossVariant(policy_loss_mode=case["policy_loss_mode"], loss_agg_mode=case["loss_agg_mode"],
                          correction=corr)
    loss, metrics = grpo_loss(logp, x["old_log_probs"], None, x["advantages"], x["mask"], clip_ratio=clip,
                              clip_ratio_low=low, clip_ratio_high=high, use_kl=False,
                              behavior_log_probs=None if corr is None else x["rollout_log_probs"], variant=variant)
    loss.backward()
    return loss, logp.grad, metrics


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_loss_and_gradient_equal_verls(case: dict) -> None:
    expected = case["expected"]
    loss, grad, metrics = run_ours(case)
    assert loss.item() == float.fromhex(expected["loss"])
    assert float((grad - torch.from_numpy(unhex(expected["grad"]))).abs().max()) == 0.0
    # metrics: verl divides by count + 1e-8 and takes the clip fraction in float32; the same numbers otherwise
    assert metrics["actor/ppo_kl"] == pytest.approx(float.fromhex(expected["ppo_kl"]), rel=1e-7, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float.fromhex(expected["pg_clipfrac"]), abs=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if correction_of(c) is not None], ids=lambda c: c["name"])
def test_weights_and_rejection_mask_equal_verls(case: dict) -> None:
    x, expected = tensors(case), case["expected"]
    weights, kept, metrics = correct(x["old_log_probs"], x["rollout_log_probs"], x["mask"], correction_of(case))
    assert torch.equal(kept, torch.from_numpy(unhex(expected["mask"])))
    if expected["weights"] is None:
        assert weights is None
    else:
        assert float((weights - torch.from_numpy(unhex(expected["weights"]))).abs().max()) == 0.0
    if expected["rs_masked_fraction"] is not None:
        fraction = metrics[SUM_PREFIX + "rollout_mismatch/masked_fraction"] / metrics[SUM_PREFIX + "tokens"]
        assert fraction == pytest.approx(expected["rs_masked_fraction"], rel=1e-8)  # verl: / (count + 1e-8)


def test_the_fixture_exercises_truncation_and_rejection() -> None:
    assert FIXTURE["verl_commit"] == "b178a3cd56f58b2d502255daba591e92833930a7"
    truncated = rejected_rows = 0
    for case in CASES:
        e, mask = case["expected"], unhex(case["inputs"]["mask"])
        if e["weights"] is not None:
            truncated += int((unhex(e["weights"]) == case["rollout_is_threshold"]).sum())
        kept = unhex(e["mask"])
        rejected_rows += int(((kept.sum(1) == 0) & (mask.sum(1) > 0)).sum())
    assert truncated > 10 and rejected_rows > 5
    assert {c["loss_agg_mode"] for c in CASES} == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                   "seq-mean-token-sum-norm"}
    assert np.isfinite([float.fromhex(c["expected"]["loss"]) for c in CASES]).all()
