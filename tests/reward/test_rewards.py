"""Reward arithmetic: weighted sum, DAPO overlong shaping, per-verifier means (values worked by hand)."""

import pytest

from services.reward.rewards import (
    OverlongConfig,
    overlong_config_from_rl_config,
    overlong_penalty,
    reward_means,
    verifier_specs,
    weighted_reward,
)


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


def test_overlong_config_from_rl_config():
    class RL:
        overlong_buffer_enable = True
        rollout_max_tokens = 2048
        overlong_buffer = 512
        overlong_buffer_penalty_factor = 1.0

    assert overlong_config_from_rl_config(RL()) == OverlongConfig(2048, 512, 1.0)
    RL.overlong_buffer_enable = False
    assert overlong_config_from_rl_config(RL()) is None


def test_reward_means():
    means = reward_means({"math_17k_acc": [1.0, 0.0, 1.0, 1.0], "format": [0.5], "empty": []})
    assert means == {"math_17k_acc_rewards/mean": 0.75, "format_rewards/mean": 0.5}


def test_verifier_specs_from_rl_config():
    class RL:
        verifier_function = ["math_17k_acc", "format"]
        verifier_weight = [1.0, 0.5]

    assert verifier_specs(RL()) == [("math_17k_acc", 1.0), ("format", 0.5)]
    RL.verifier_weight = [1.0]
    with pytest.raises(ValueError, match="verifier_weight has 1"):
        verifier_specs(RL())


def test_reward_settings_from_a_mindspeed_yaml(repo_root):
    from services.common.config import load_config

    config = load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml", overrides=[
        "rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=16", "rl_config.rollout_max_tokens=64"])
    assert verifier_specs(config.rl_config) == [("math_17k_acc", 1.0)]
    assert overlong_config_from_rl_config(config.rl_config) == OverlongConfig(64, 16, 1.0)
