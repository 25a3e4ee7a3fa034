"""Rewards to advantages: group normalisation, DAPO overlong shaping, and the KL coefficient controller.

Pure numpy functions the coordinator runs between the reward service and the trainer.

- `compute_group_advantages` (YAML `rl_config.adv_estimator: group_norm`, GRPO,
  https://arxiv.org/abs/2402.03300): the samples of one prompt form a group of
  `n_samples_per_prompt`; A = (r - mean(group)) / (std(group) + 1e-6), std unbiased (N - 1),
  in float64. The trainer broadcasts each sample's A over its response tokens.
- `apply_overlong_penalty` (`overlong_buffer_enable`, DAPO https://arxiv.org/abs/2503.14476):
  a linear penalty for responses that run into the last `overlong_buffer` tokens of
  `rollout_max_tokens`, added to the reward before normalisation. This is rlfabric's one home of
  overlong shaping: the coordinator applies it to every sample's final reward (the verifiers' weighted
  sum); the per-verifier scores, and so `filter_groups_metric` and `{name}_rewards/mean`, stay unshaped,
  as in MindSpeed-RL's `compute_verifier_score`.
- The estimators verl offers beyond MindSpeed-RL's (`rl_config.adv_estimator`, with verl's names; verl's
  `verl/trainer/ppo/core_algos.py` is the reference, and tests/coordinator/test_advantages_verl.py checks each one
  against it on the same inputs in float64, max difference 0), all for outcome rewards (one scalar per sample):
  `group_norm` without the std division (`rlfabric.norm_adv_by_std_in_grpo: false`, Dr.GRPO,
  https://arxiv.org/abs/2503.20783): A = r - mean(group);
  `rloo` (https://arxiv.org/abs/2402.14740): A = r - mean(the other n - 1 samples of the group);
  `reinforce_plus_plus` (https://arxiv.org/abs/2501.03262): the return r whitened over every response token of
  the batch (a sample weighs as many tokens as it has); `reinforce_plus_plus_baseline`: the same on r - mean(group).
  They compute in torch float64 with verl's order of operations: the token-level whitening sums a padded
  `[samples, longest response]` matrix, whose rounding (1e-16) depends on that layout.
- `FixedKLController` / `AdaptiveKLController` (`kl_ctrl_type`, `init_kl_coef`, `kl_target`,
  `kl_horizon`): the weight of the KL term in the loss; the adaptive rule is the proportional
  controller of Ziegler et al., https://arxiv.org/abs/1909.08593 (section 2.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from services.common.config.rl import ADV_ESTIMATORS

ADVANTAGE_EPS = 1e-6  # added to the group std, as MindSpeed-RL's group_norm does
_WHITEN_EPS = 1e-8  # verl's masked_whiten: added to the token count and to the variance


def _as_float64(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one value per sample (1-D), got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(
            f"{name} holds non-finite values at sample indices {bad[:8].tolist()}: {array[bad[:8]]}"
        )
    return array


def compute_group_advantages(rewards: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """Group-normalised advantages, one per sample.

    Args:
        rewards: `[num_prompts * n]` final rewards, grouped contiguously: samples
            `g*n .. g*n + n - 1` answer prompt g.
        n: group size (`rl_config.n_samples_per_prompt`).

    Returns:
        `[num_prompts * n]` float64 advantages. A group whose rewards are all equal gets exactly
        0 (not a rounding residue: mean(0.1, 0.1, 0.1) != 0.1 in floating point). A group of one
        sample has no spread (its unbiased std is undefined) and also gets 0, so n == 1 trains
        nothing; use n >= 2.

    Example:
        rewards [1, 0, 0, 1] with n = 4: mean 0.5, unbiased std sqrt(1/3) = 0.57735,
        advantages +-0.5 / (0.57735 + 1e-6) = [0.866024, -0.866024, -0.866024, 0.866024].
    """
    if n < 1:
        raise ValueError(f"group size n (rl_config.n_samples_per_prompt) must be >= 1, got {n}")
    array = _as_float64(rewards, "rewards")
    if array.size % n:
        raise ValueError(
            f"{array.size} rewards do not split into groups of n_samples_per_prompt={n}; "
            "every prompt needs exactly n samples"
        )
    groups = array.reshape(-1, n)
    if n == 1:
        return np.zeros_like(array)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, ddof=1, keepdims=True)
    advantages = (groups - mean) / (std + ADVANTAGE_EPS)
    constant = groups.max(axis=1) == groups.min(axis=1)
    advantages[constant] = 0.0
    return advantages.reshape(-1)


def _groups(rewards: Sequence[float] | np.ndarray, n: int):
    """`[num_prompts, n]` float64 torch tensor of the rewards, checked as compute_group_advantages checks them."""
    import torch

    if n < 1:
        raise ValueError(f"group size n (rl_config.n_samples_per_prompt) must be >= 1, got {n}")
    array = _as_float64(rewards, "rewards")
    if array.size % n:
        raise ValueError(f"{array.size} rewards do not split into groups of n_samples_per_prompt={n}; "
                         "every prompt needs exactly n samples")
    return torch.from_numpy(array.copy()).reshape(-1, n)


def compute_mean_baseline_advantages(rewards: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """Dr.GRPO (`group_norm` with `rlfabric.norm_adv_by_std_in_grpo: false`): A = r - mean(group), float64.

    No division by the group's std (which favours groups of nearly equal rewards). As group_norm, a group whose
    rewards are all equal gets exactly 0; a group of one sample keeps its reward (verl's mean of one sample is 0).
    """
    groups = _groups(rewards, n)
    if n == 1:
        return groups.reshape(-1).numpy()
    advantages = groups - groups.mean(dim=1, keepdim=True)
    advantages[groups.amax(dim=1) == groups.amin(dim=1)] = 0.0
    return advantages.reshape(-1).numpy()


def compute_rloo_advantages(rewards: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    """RLOO, one float64 advantage per sample: A = r - mean(the group's other samples).

    Written as verl writes it, r * n / (n - 1) - mean(group) * n / (n - 1) (the same value, and its rounding).
    A group of one sample has no other sample: its advantage is its reward, as in verl.
    """
    groups = _groups(rewards, n)
    if n == 1:
        return groups.reshape(-1).numpy()
    mean = groups.mean(dim=1, keepdim=True)
    return (groups * n / (n - 1) - mean * n / (n - 1)).reshape(-1).numpy()


def _whiten_over_tokens(values, response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-sample `values` (float64 torch `[B]`) whitened over every response token of the batch.

    Each sample's value stands on each of its tokens; mean and variance (unbiased over tokens) are taken over all
    of them, as verl's `masked_whiten` takes them over its padded `[B, T]` matrix; a sample of length 0 gets 0.
    """
    import torch

    lengths = np.asarray(response_lengths, dtype=np.int64).reshape(-1)
    if lengths.shape[0] != values.shape[0] or (lengths < 0).any():
        raise ValueError(f"{values.shape[0]} rewards need as many response lengths >= 0, got {lengths.tolist()[:8]}")
    total = int(lengths.sum())
    if total < 2:
        raise ValueError(f"REINFORCE++ whitens over the batch's response tokens and needs at least 2, got {total}")
    width = int(lengths.max())
    mask = (torch.arange(width).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)).to(torch.float64)
    tokens = values.unsqueeze(-1).tile([1, width]) * mask
    count = mask.sum()
    mean = (tokens * mask).sum() / (count + _WHITEN_EPS)
    variance = ((tokens - mean) ** 2 * mask).sum() / (count + _WHITEN_EPS) * (count / (count - 1))
    whitened = (tokens - mean) * torch.rsqrt(variance + _WHITEN_EPS) * mask
    return np.where(lengths > 0, whitened[:, 0].numpy(), 0.0)


def compute_reinforce_plus_plus_advantages(rewards: Sequence[float] | np.ndarray,
                                           response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """REINFORCE++ with outcome rewards and no discount (gamma 1): every token's return is the sample's reward,
    whitened over all response tokens of the batch (`_whiten_over_tokens`); one float64 value per sample."""
    import torch

    return _whiten_over_tokens(torch.from_numpy(_as_float64(rewards, "rewards").copy()), response_lengths)


def compute_reinforce_plus_plus_baseline_advantages(rewards: Sequence[float] | np.ndarray, n: int,
                                                    response_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """REINFORCE++-baseline: r - mean(group) (a group of one: r), whitened over the batch's response tokens."""
    groups = _groups(rewards, n)
    centred = groups - groups.mean(dim=1, keepdim=True) if n > 1 else groups
    return _whiten_over_tokens(centred.reshape(-1), response_lengths)


def compute_advantages(estimator: str, rewards: Sequence[float] | np.ndarray, n: int,
                       response_lengths: Sequence[int] | np.ndarray, *, norm_adv_by_std: bool = True) -> np.ndarray:
    """The advantages of `rl_config.adv_estimator`, one float64 value per sample (rewards grouped as for
    compute_group_advantages; `response_lengths` in tokens, 0 for a sample that contributes no tokens)."""
    if estimator == "group_norm":
        return compute_group_advantages(rewards, n) if norm_adv_by_std else compute_mean_baseline_advantages(rewards, n)
    if estimator == "rloo":
        return compute_rloo_advantages(rewards, n)
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_advantages(rewards, response_lengths)
    if estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_plus_plus_baseline_advantages(rewards, n, response_lengths)
    raise ValueError(f"unsupported rl_config.adv_estimator {estimator!r}; supported: {list(ADV_ESTIMATORS)}")


def compute_overlong_penalty(
    response_lengths: Sequence[int] | np.ndarray,
    rollout_max_tokens: int,
    overlong_buffer: int,
    penalty_factor: float,
) -> np.ndarray:
    """DAPO soft overlong punishment, one value (<= 0) per sample, as MindSpeed-RL computes it.

    expected = rollout_max_tokens - overlong_buffer; exceed = min(length - expected, overlong_buffer);
    penalty = min(-exceed / overlong_buffer * penalty_factor, 0). Responses up to `expected`
    tokens get 0; the penalty falls linearly to -penalty_factor at `rollout_max_tokens` and stays
    there (the cap on `exceed`) for anything longer.

    Args:
        response_lengths: `[num_samples]` response lengths in tokens, as generated (the sample's
            `response_length`, the end-of-sequence token included when the engine produced one).
        rollout_max_tokens: `rl_config.rollout_max_tokens` (the config requires it to equal
            `sampling_config.max_tokens`, the generation limit).
        overlong_buffer: `rl_config.overlong_buffer`, in tokens; 0 < buffer < rollout_max_tokens.
        penalty_factor: `rl_config.overlong_buffer_penalty_factor`.
    """
    if not 0 < overlong_buffer < rollout_max_tokens:
        raise ValueError(
            f"rl_config.overlong_buffer must be > 0 and < rollout_max_tokens={rollout_max_tokens}, "
            f"got {overlong_buffer}"
        )
    lengths = _as_float64(response_lengths, "response_lengths")
    expected = rollout_max_tokens - overlong_buffer
    exceed = np.minimum(lengths - expected, overlong_buffer)
    return np.minimum(-exceed / overlong_buffer * penalty_factor, 0.0)


def apply_overlong_penalty(
    rewards: Sequence[float] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    rollout_max_tokens: int,
    overlong_buffer: int,
    penalty_factor: float,
) -> np.ndarray:
    """Rewards plus the DAPO overlong penalty (`compute_overlong_penalty`), float64."""
    array = _as_float64(rewards, "rewards")
    penalty = compute_overlong_penalty(response_lengths, rollout_max_tokens, overlong_buffer, penalty_factor)
    if penalty.shape != array.shape:
        raise ValueError(
            f"{array.size} rewards but {penalty.size} response lengths; pass one of each per sample"
        )
    return array + penalty


class KLController(Protocol):
    """The current KL coefficient (`value`) and its update after each iteration."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """`kl_ctrl_type: fixed`: the coefficient stays `init_kl_coef`."""

    def __init__(self, init_kl_coef: float) -> None:
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: a fixed coefficient ignores the measured KL."""


class AdaptiveKLController:
    """`kl_ctrl_type: adaptive`: steer the coefficient so the measured KL approaches `kl_target`.

    After each iteration, e = clip(current_kl / kl_target - 1, -0.2, 0.2) and
    value *= 1 + e * n_steps / kl_horizon: a KL above target raises the coefficient, one below
    lowers it, by at most 20% per `kl_horizon` samples.
    """

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: float) -> None:
        if kl_target <= 0 or kl_horizon <= 0:
            raise ValueError(
                f"kl_ctrl_type: adaptive needs rl_config.kl_target > 0 and kl_horizon > 0, "
                f"got kl_target={kl_target}, kl_horizon={kl_horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = float(kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Apply one step of the rule.

        Args:
            current_kl: the KL measured in this iteration (e.g. the mean `actor/kl_loss`).
            n_steps: how many samples that iteration trained on (global batch x n).
        """
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL measurement: {current_kl}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")


def make_kl_controller(
    kl_ctrl_type: str,
    init_kl_coef: float,
    kl_target: float | None = None,
    kl_horizon: float | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `rl_config.kl_ctrl_type`."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(init_kl_coef)
    if kl_ctrl_type == "adaptive":
        if kl_target is None or kl_horizon is None:
            raise ValueError("kl_ctrl_type: adaptive needs rl_config.kl_target and rl_config.kl_horizon")
        return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
    raise ValueError(
        f"unsupported rl_config.kl_ctrl_type {kl_ctrl_type!r}; supported: {list(KL_CONTROLLERS)}"
    )
