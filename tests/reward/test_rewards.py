"""The final reward of a sample: the weighted sum (values worked by hand)."""

import pytest

from services.reward.rewards import weighted_reward


def test_weighted_reward():
    # 1.0 * 1 + 0.5 * (-0.5) = 0.75
    assert weighted_reward([1.0, -0.5], [1.0, 0.5]) == pytest.approx(0.75)
    assert weighted_reward([1.0, 1.0], [2.0, 0.0]) == 2.0
    with pytest.raises(ValueError, match="verifier_function and verifier_weight"):
        weighted_reward([1.0], [1.0, 2.0])
