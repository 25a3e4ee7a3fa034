"""Reward arithmetic on a worker: weighted sum, DAPO overlong shaping (values worked by hand)."""

import pytest

from services.reward.rewards import OverlongConfig, overlong_penalty, weighted_reward


def test_weighted_reward():
    # 1.0 * 1 + 0.5 * (-0.5) = 0.75
    assert weighted_reward([1.0, -0.5], [1.0, 0.5]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="verifier_function and verifier_weight"):
        weighted_reward([1.0], [1.0, 2.0])


@pytest.mark.parametrize(("length", "penalty"), [
    (100, 0.0),  # well under expected = 1024 - 256 = 768
    (768, 0.0),  # exactly expected
    (896, -0.5),  # exceed 128 of 256 -> -0.5 * factor 1
    (1024, -1.0),  # exceed the whole buffer
    (5000, -1.0),  # exceed is capped at the buffer
])
def test_overlong_penalty(length, penalty):
    config = OverlongConfig(rollout_max_tokens=1024, overlong_buffer=256, overlong_buffer_penalty_factor=1.0)
    assert overlong_penalty(length, config) == pytest.approx(penalty)


def test_overlong_factor_and_validation():
    config = OverlongConfig(rollout_max_tokens=100, overlong_buffer=20, overlong_buffer_penalty_factor=2.0)
    assert overlong_penalty(90, config) == pytest.approx(-1.0)  # exceed 10 of 20 -> -0.5 * 2
    with pytest.raises(ValueError, match="overlong_buffer"):
        OverlongConfig(rollout_max_tokens=100, overlong_buffer=100)
