"""Group advantages, DAPO overlong shaping and the KL controllers, with values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.advantages import (
    AdaptiveKLController,
    FixedKLController,
    apply_overlong_penalty,
    compute_group_advantages,
    compute_overlong_penalty,
    make_kl_controller,
)


def test_worked_example_two_groups():
    # group 0: [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350
    #   A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    # group 1: [0.5, 1, 0, 0.5]: mean 0.5; unbiased var = (0 + 0.25 + 0.25 + 0) / 3 = 1/6, std = 0.408248
    #   A = [0, 0.5, -0.5, 0] / (0.408248 + 1e-6) = [0, 1.224742, -1.224742, 0]
    adv = compute_group_advantages([1, 0, 0, 1, 0.5, 1, 0, 0.5], n=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    b = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    assert adv.dtype == np.float64
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, b, -b, 0.0], abs=1e-12)
    assert adv[:4].tolist() == pytest.approx([0.866024, -0.866024, -0.866024, 0.866024], abs=1e-6)
    assert adv[5] == pytest.approx(1.224742, abs=1e-6)


def test_std_is_unbiased():
    # [1, 0]: mean 0.5; unbiased std = sqrt(0.5 / 1) = 0.707107 -> A = 0.5 / 0.707108 = 0.707106;
    # the biased std (0.5) would give 0.999998 instead.
    adv = compute_group_advantages([1.0, 0.0], n=2)
    assert adv[0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-12)
    assert adv[0] == pytest.approx(0.707106, abs=1e-6)
    rewards = np.random.default_rng(0).normal(size=8)
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(compute_group_advantages(rewards, n=8), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 0.1, 1 / 3, 7.3])
def test_equal_rewards_give_exactly_zero(value):
    rewards = [value] * 8
    assert np.all(compute_group_advantages(rewards, n=8) == 0.0)
    # Why this needs care: the floating-point mean of three 0.1s is not 0.1.
    assert np.mean([0.1, 0.1, 0.1]) != 0.1
    assert np.all(compute_group_advantages([0.1, 0.1, 0.1, 1.0, 0.0, 1.0], n=3)[:3] == 0.0)


def test_group_of_one_gets_zero():
    assert compute_group_advantages([1.0, 0.0, 0.5], n=1).tolist() == [0.0, 0.0, 0.0]


def test_computed_in_float64_from_float32_input():
    rewards = np.array([1e-4, 2e-4, 3e-4, 4e-4], dtype=np.float32)
    adv = compute_group_advantages(rewards, n=4)
    r64 = rewards.astype(np.float64)
    assert adv.dtype == np.float64
    np.testing.assert_allclose(adv, (r64 - r64.mean()) / (r64.std(ddof=1) + 1e-6), rtol=0, atol=1e-12)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        compute_group_advantages([1, 0, 1], n=4)
    with pytest.raises(ValueError, match=">= 1"):
        compute_group_advantages([1, 0], n=0)
    with pytest.raises(ValueError, match=r"non-finite values at sample indices \[1\]"):
        compute_group_advantages([1, float("nan")], n=2)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(2, 8),
    groups=st.integers(1, 4),
    data=st.data(),
)
def test_advantage_properties(n, groups, data):
    rewards = np.array(data.draw(st.lists(st.floats(-10, 10), min_size=n * groups, max_size=n * groups)))
    adv = compute_group_advantages(rewards, n).reshape(groups, n)
    for g, row in zip(rewards.reshape(groups, n), adv, strict=True):
        assert abs(row.sum()) < 1e-9  # centred within the group
        if g.max() == g.min():
            assert np.all(row == 0.0)
        else:
            # scaled to unit unbiased std, short of it by the epsilon only
            std = g.std(ddof=1)
            assert row.std(ddof=1) == pytest.approx(std / (std + 1e-6), abs=1e-9)
            # order-preserving
            assert np.all(np.diff(row[np.argsort(g, kind="stable")]) >= 0)
    shifted = compute_group_advantages(rewards + 3.0, n).reshape(groups, n)
    np.testing.assert_allclose(shifted, adv, atol=1e-8)


def test_overlong_penalty_values():
    # rollout_max_tokens 20, buffer 4, factor 1: expected = 16
    #   len 10 -> exceed -6 -> min(1.5, 0) = 0;  len 16 -> 0;  len 17 -> -1/4 = -0.25
    #   len 18 -> -0.5;  len 20 -> -1.0;  len 24 -> exceed min(8, 4) = 4 -> -1.0 (capped, as MindSpeed-RL)
    penalty = compute_overlong_penalty([10, 16, 17, 18, 20, 24], 20, 4, 1.0)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    # factor 0.5 halves it
    assert compute_overlong_penalty([18], 20, 4, 0.5).tolist() == pytest.approx([-0.25])
    # added to the reward: 1 + (-0.5) = 0.5; 0 + 0 = 0
    shaped = apply_overlong_penalty(
        [1.0, 0.0], [18, 3], rollout_max_tokens=20, overlong_buffer=4, penalty_factor=1.0
    )
    assert shaped.tolist() == pytest.approx([0.5, 0.0])


def test_overlong_penalty_rejects_bad_buffer():
    for buffer in (0, 20, 25):
        with pytest.raises(ValueError, match="overlong_buffer"):
            compute_overlong_penalty([1], 20, buffer, 1.0)
    with pytest.raises(ValueError, match="2 rewards but 1 response lengths"):
        apply_overlong_penalty([1.0, 0.0], [3], 20, 4, 1.0)


def test_fixed_kl_controller_never_moves():
    ctrl = make_kl_controller("fixed", 0.001)
    assert isinstance(ctrl, FixedKLController)
    for kl in (0.0, 5.0, 100.0):
        ctrl.update(kl, n_steps=256)
    assert ctrl.value == 0.001


def test_adaptive_kl_controller_by_hand():
    # init 0.1, target 0.01, horizon 100, 10 samples per step:
    #   kl 0.02  -> e = clip(2 - 1) = 0.2   -> x (1 + 0.2 * 10/100) = x1.02 -> 0.102
    #   kl 0.005 -> e = clip(-0.5) = -0.2   -> x0.98               -> 0.09996
    #   kl 0.011 -> e = 0.1                 -> x1.01               -> 0.1009596
    ctrl = make_kl_controller("adaptive", 0.1, kl_target=0.01, kl_horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(0.02, n_steps=10)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(0.005, n_steps=10)
    assert ctrl.value == pytest.approx(0.09996)
    ctrl.update(0.011, n_steps=10)
    assert ctrl.value == pytest.approx(0.1009596)
    ctrl.update(0.01, n_steps=10)  # on target: unchanged
    assert ctrl.value == pytest.approx(0.1009596)


def test_kl_controller_errors():
    with pytest.raises(ValueError, match=r"supported: \['fixed', 'adaptive'\]"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="kl_target"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="kl_horizon > 0"):
        AdaptiveKLController(0.1, kl_target=0.01, kl_horizon=0)
    with pytest.raises(ValueError, match="non-finite"):
        AdaptiveKLController(0.1, 0.01, 100).update(float("nan"), 10)
