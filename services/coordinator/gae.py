"""PPO with a critic (`rl_config.adv_estimator: gae`): token-level rewards and GAE advantages and returns.

Pure float64 functions, as MindSpeed-RL (commit 05a90d7) defines them in
`mindspeed_rl/trainer/utils/compute_utils.py`; tests/coordinator/test_gae.py checks them against that code run end
to end on the same inputs (tests/mindspeed_expected.py), maximum difference 0. Nothing calls them yet: the critic
role and the PPO config keys come later (docs: issue 27).

- `token_level_scores`: each sample's rule score on its last response token (position `response_length - 1`),
  0 elsewhere (`compute_advantage` with `use_kl_in_reward: false`, the branch ppo_qwen25_32b_A3.yaml takes).
  Upstream puts the score in a float32 tensor there; rlfabric keeps float64, the same for any float32-representable
  score (0/1 rule rewards, their dyadic weighted sums).
- `apply_kl_in_reward` (`use_kl_in_reward: true`, `apply_kl_penalty`): rewards_t = score_t - beta * kl_t, with kl_t
  the `rl_config.kl_penalty` estimator of the old policy against the reference (the caller's, e.g. the trainer's
  `kl_penalty(old_log_probs, ref_log_probs, kind)`), zero past each response; also the batch's KL measure that
  upstream feeds its KL controller: the mean over samples of each sample's mean KL over its tokens. With the
  flag off MindSpeed-RL's PPO applies no KL at all: its PPO actor loss has no KL term.
- `gae_advantages_and_returns` (`compute_gae_advantage_return`, Schulman et al.,
  https://arxiv.org/abs/1506.02438): delta_t = r_t + gamma V_{t+1} - V_t (V past the response is 0),
  A_t = delta_t + gamma lam A_{t+1}, returns_t = A_t + V_t (before whitening), then A whitened over every response
  token of the batch (`masked_whiten`: unbiased variance, + 1e-8 under the square root; always on: upstream's
  `advantage_whiten` key is declared and never read). The recursion runs through every position up to a response's
  end, positions the mask leaves out inside it (a multi-turn tool's tokens) included, as MindSpeed-RL runs it; verl's
  function instead skips them, carrying V and A across (tests/coordinator/mindspeed_ppo.json records both).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_WHITEN_EPS = 1e-8  # masked_whiten's, under the square root


def _matrix(values: Sequence | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"{name} must be [samples, response tokens], got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds non-finite values at {np.argwhere(~np.isfinite(array))[:4].tolist()}")
    return array


def _lengths(response_lengths: Sequence[int] | np.ndarray, samples: int, width: int) -> np.ndarray:
    lengths = np.asarray(response_lengths, dtype=np.int64).reshape(-1)
    if lengths.shape[0] != samples or (lengths < 1).any() or (lengths > width).any():
        raise ValueError(f"{samples} samples need as many response lengths in 1..{width}, got {lengths.tolist()[:8]}")
    return lengths


def token_level_scores(scores: Sequence[float] | np.ndarray, response_lengths: Sequence[int] | np.ndarray,
                       width: int | None = None) -> np.ndarray:
    """`[samples, width]` float64: each sample's score on its last response token, 0 elsewhere.

    `width` defaults to the longest response; a response must hold at least one token (upstream would put a
    zero-length response's score on the last column of the padding).
    """
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    if not np.isfinite(values).all():
        raise ValueError(f"scores hold non-finite values: {values[~np.isfinite(values)][:4]}")
    width = int(np.max(response_lengths)) if width is None else width
    lengths = _lengths(response_lengths, values.shape[0], width)
    rewards = np.zeros((values.shape[0], width), dtype=np.float64)
    rewards[np.arange(values.shape[0]), lengths - 1] = values
    return rewards


def apply_kl_in_reward(token_scores: Sequence | np.ndarray, kl: Sequence | np.ndarray,
                       response_lengths: Sequence[int] | np.ndarray, kl_coef: float) -> tuple[np.ndarray, float]:
    """(token_scores - kl_coef * kl over each response's tokens, the batch's mean per-sample KL), float64.

    Args:
        token_scores: `[samples, width]`, `token_level_scores`.
        kl: `[samples, width]` per-token KL estimate of the old policy against the reference; its values past a
            response's length are ignored.
        response_lengths: each sample's response length (the KL counts over the whole response, tool tokens too,
            as upstream's `generate_mask` does).
        kl_coef: beta, the KL controller's current value.

    Returns:
        The token-level rewards and the KL measure that upstream passes to `kl_ctrl.update` (with n_steps = the
        number of samples).
    """
    scores = _matrix(token_scores, "token_scores")
    kld = _matrix(kl, "kl")
    if kld.shape != scores.shape:
        raise ValueError(f"kl has shape {kld.shape}, token_scores {scores.shape}")
    lengths = _lengths(response_lengths, scores.shape[0], scores.shape[1])
    inside = np.arange(scores.shape[1])[None, :] < lengths[:, None]
    kld = np.where(inside, kld, 0.0)
    # Each sample's mean over its tokens, then the mean over samples, in torch as upstream sums (the rounding of a
    # row sum depends on the order).
    row_sums = torch.from_numpy(kld).sum(dim=-1)
    current_kl = torch.mean(row_sums / torch.from_numpy(lengths.astype(np.float64)), dim=0).item()
    return scores - kl_coef * kld, current_kl


def _as_mask(response_mask: Sequence | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    mask = np.asarray(response_mask)
    if mask.shape != shape:
        raise ValueError(f"response_mask has shape {mask.shape}, the token matrices {shape}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError("response_mask must hold only 0 and 1 (or booleans)")
    return mask.astype(bool)


def _whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`advantages` whitened over the masked tokens, rounded as upstream's masked_whiten rounds with its int64 mask.

    With an integer mask upstream's token count (+ 1e-8) and its Bessel factor n / (n - 1) are float32 tensors: the
    1e-8 vanishes for any count >= 1 and the factor is n / (n - 1) rounded to float32. A single token keeps the
    biased variance (factor 1), as upstream; no token at all has nothing to whiten over and is refused.
    """
    n = int(mask.sum())
    if n == 0:
        raise ValueError("GAE whitens over the batch's response tokens: the response mask selects none")
    count = float(np.float32(n))
    total = torch.where(mask, advantages, 0.0).sum()
    mean = total / count
    variance = torch.where(mask, (advantages - mean) ** 2, 0.0).sum() / count
    bessel = 1.0 if n == 1 else float(np.float32(n) / np.float32(n - 1))
    return (advantages - mean) * torch.rsqrt(variance * bessel + _WHITEN_EPS)


def gae_advantages_and_returns(token_rewards: Sequence | np.ndarray, values: Sequence | np.ndarray,
                               response_mask: Sequence | np.ndarray, gamma: float,
                               lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages (whitened over the batch's response tokens) and returns, `[samples, width]` float64 each.

    Args:
        token_rewards: `[samples, width]`, `token_level_scores` or `apply_kl_in_reward`'s rewards.
        values: `[samples, width]`, the critic's values of the response tokens (those the rollout's old critic gave).
        response_mask: `[samples, width]` 0/1: the tokens that train. Positions after a row's last 1 are padding:
            their rewards and values are never read (upstream pads them with 0, which is what they count as here).
            0s inside a response (tool tokens) stay part of the recursion, as in MindSpeed-RL.
        gamma: `rl_config.gamma`, the discount.
        lam: `rl_config.lam`, GAE's lambda.

    Returns:
        (advantages, returns), 0 wherever the mask is 0 (upstream leaves values there that no loss reads).
    """
    rewards = _matrix(token_rewards, "token_rewards")
    vals = _matrix(values, "values")
    if vals.shape != rewards.shape:
        raise ValueError(f"values have shape {vals.shape}, token_rewards {rewards.shape}")
    mask = _as_mask(response_mask, rewards.shape)
    ends = np.where(mask.any(axis=1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0)
    inside = np.arange(mask.shape[1])[None, :] < ends[:, None]
    r = torch.from_numpy(np.where(inside, rewards, 0.0))
    v = torch.from_numpy(np.where(inside, vals, 0.0))
    discount = gamma * lam  # one product, as upstream forms it, before it scales the next step's advantage
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64)
    next_advantage = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_advantage = delta + discount * next_advantage
        advantages[:, t] = next_advantage
        next_value = v[:, t]
    returns = advantages + v
    keep = torch.from_numpy(mask)
    whitened = _whiten(advantages, keep)
    return torch.where(keep, whitened, 0.0).numpy(), torch.where(keep, returns, 0.0).numpy()
