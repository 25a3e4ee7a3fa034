"""The estimators rlfabric takes from verl against verl's own functions: Dr.GRPO, RLOO, REINFORCE++ and its baseline.

tests/coordinator/verl_advantages.json holds fixed float64 rewards and response lengths and what verl's
`compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)`, `compute_rloo_outcome_advantage`,
`compute_reinforce_plus_plus_outcome_advantage` (gamma 1) and `compute_reinforce_plus_plus_baseline_outcome_advantage`
returned for them (made by tests/verl_expected.py from a verl checkout, values stored exactly). Every value must be
equal: maximum difference 0. Hand-worked cases follow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from services.coordinator.advantages import (
    compute_advantages,
    compute_group_advantages,
    compute_mean_baseline_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
)
from tests.verl_expected import unhex

FIXTURE = json.loads((Path(__file__).parent / "verl_advantages.json").read_text())
CASES = FIXTURE["cases"]


def ours(name: str, rewards: np.ndarray, n: int, lengths: list[int]) -> np.ndarray:
    return {"dr_grpo": lambda: compute_mean_baseline_advantages(rewards, n),
            "rloo": lambda: compute_rloo_advantages(rewards, n),
            "reinforce_plus_plus": lambda: compute_reinforce_plus_plus_advantages(rewards, lengths),
            "reinforce_plus_plus_baseline": lambda: compute_reinforce_plus_plus_baseline_advantages(rewards, n, lengths),
            }[name]()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_equal_to_verl_in_float64(case: dict, estimator: str) -> None:
    rewards, expected = unhex(case["rewards"]), unhex(case["expected"][estimator])
    got = ours(estimator, rewards, case["n"], case["lengths"])
    assert got.dtype == np.float64 and got.shape == expected.shape
    assert float(np.max(np.abs(got - expected))) == 0.0
    assert np.array_equal(got, expected)


def test_the_fixture_covers_what_it_claims() -> None:
    assert FIXTURE["verl_commit"] == "b178a3cd56f58b2d502255daba591e92833930a7"
    assert {c["n"] for c in CASES} >= {3, 5, 8, 16}  # torch's and numpy's means differ in rounding from n = 5 on
    binary = next(c for c in CASES if "constant" in c["name"])
    assert unhex(binary["expected"]["dr_grpo"])[:16].tolist() == [0.0] * 16  # all-1 and all-0 groups


def test_dispatch_by_estimator_name() -> None:
    rewards, lengths = [1.0, 0.0, 0.5, 0.25], [3, 1, 2, 2]
    assert np.array_equal(compute_advantages("group_norm", rewards, 2, lengths),
                          compute_group_advantages(rewards, 2))
    assert np.array_equal(compute_advantages("group_norm", rewards, 2, lengths, norm_adv_by_std=False),
                          [0.5, -0.5, 0.125, -0.125])
    assert np.array_equal(compute_advantages("rloo", rewards, 2, lengths), [1.0, -1.0, 0.25, -0.25])
    with pytest.raises(ValueError, match="unsupported rl_config.adv_estimator 'gae'"):
        compute_advantages("gae", rewards, 2, lengths)


def test_rloo_is_the_reward_minus_the_mean_of_the_others() -> None:
    # group [1, 0, 0, 1]: each sample's baseline is the mean of the other three
    #   sample 0: 1 - (0 + 0 + 1) / 3 = 2/3;  sample 1: 0 - (1 + 0 + 1) / 3 = -2/3
    got = compute_rloo_advantages([1.0, 0.0, 0.0, 1.0], 4)
    assert got.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-15)
    assert compute_rloo_advantages([0.3, -1.0], 1).tolist() == [0.3, -1.0]  # no other sample: the reward (verl)


def test_dr_grpo_does_not_divide_by_the_std() -> None:
    # group [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; group_norm would scale by 1 / 0.5 = 2
    assert compute_mean_baseline_advantages([1.0, 0.0, 0.0, 0.0], 4).tolist() == [0.75, -0.25, -0.25, -0.25]
    assert compute_mean_baseline_advantages([0.1] * 3, 3).tolist() == [0.0] * 3  # equal rewards: exactly 0


def test_reinforce_plus_plus_whitens_over_tokens_not_samples() -> None:
    # rewards [1, 0] over 3 and 1 tokens: token values [1, 1, 1, 0]; mean 3/4, unbiased var = (3 * 1/16 + 9/16) / 3
    # = 1/4, so A = (r - 3/4) / sqrt(1/4 + 1e-8) (the mean and count carry verl's 1e-8 too).
    mean = 3 / (4 + 1e-8)
    var = (3 * (1 - mean) ** 2 + mean**2) / (4 + 1e-8) * (4 / 3)
    got = compute_reinforce_plus_plus_advantages([1.0, 0.0], [3, 1])
    assert got.tolist() == pytest.approx([(1 - mean) / math.sqrt(var + 1e-8), -mean / math.sqrt(var + 1e-8)],
                                         abs=1e-12)
    assert got[1] == pytest.approx(-1.5, abs=1e-6)  # a per-sample whitening would give -0.707
    # the baseline variant centres each group first: [1, 0] -> [0.5, -0.5], then whitens the same way
    assert compute_reinforce_plus_plus_baseline_advantages([1.0, 0.0], 2, [3, 1])[0] > 0


def test_reinforce_plus_plus_input_errors() -> None:
    with pytest.raises(ValueError, match="response lengths"):
        compute_reinforce_plus_plus_advantages([1.0, 0.0], [3])
    with pytest.raises(ValueError, match="at least 2"):
        compute_reinforce_plus_plus_advantages([1.0], [1])
    # a sample without tokens (a failed one) gets 0 and does not move the statistics
    with_failed = compute_reinforce_plus_plus_advantages([1.0, 0.0, 5.0], [3, 1, 0])
    assert with_failed[2] == 0.0
    assert with_failed[:2].tolist() == compute_reinforce_plus_plus_advantages([1.0, 0.0], [3, 1]).tolist()
