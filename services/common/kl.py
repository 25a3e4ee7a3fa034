"""Per-token estimators of KL(pi || pi_ref) from log-probs (`rl_config.kl_penalty`), as MindSpeed-RL's
`compute_kl_penalty` defines them: the one home of the formulas that the trainer's KL loss term
(services/trainer/grpo_loss.py) and PPO's KL in the reward (services/coordinator/ppo.py) both use::

    d_t  = log p_ref_t - log p_t
    k3_t = clamp(exp(clamp(d_t, -20, 20)) - clamp(d_t, -20, 20) - 1, -10, 10)     low_var_kl
    k1_t = log p_t - log p_ref_t                                                 kl
         | |log p_t - log p_ref_t|                                               abs
    k2_t = 0.5 * (log p_t - log p_ref_t)^2                                       mse

tests/coordinator/test_gae.py checks each against MindSpeed-RL's own function on the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Clamps of the k3 estimator: exp(20) is finite in bf16/fp32, and bounding k3 keeps one off-support token from
# dominating the loss.
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def _kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    d = torch.clamp(ref_log_probs - log_probs, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(d) - d - 1.0, -_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


def _kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return log_probs - ref_log_probs


def _kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return (log_probs - ref_log_probs).abs()


def _kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


# YAML `rl_config.kl_penalty` -> per-token estimator of KL(pi || pi_ref), `[batch, seq]`.
KL_PENALTIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "low_var_kl": _kl_k3,
    "kl": _kl_k1,
    "abs": _kl_abs,
    "mse": _kl_k2,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL penalty between a policy and the reference.

    Args:
        log_probs: `[batch, seq]` the policy's (with gradient in the loss; the old policy's in PPO's reward).
        ref_log_probs: `[batch, seq]` the reference's (no gradient needed).
        kind: one of `KL_PENALTIES` (YAML `rl_config.kl_penalty`).

    Returns:
        `[batch, seq]`; the caller masks and aggregates it.
    """
    try:
        estimator = KL_PENALTIES[kind]
    except KeyError:
        raise ValueError(
            f"unsupported kl_penalty {kind!r} (rl_config.kl_penalty); supported: {sorted(KL_PENALTIES)}"
        ) from None
    return estimator(log_probs, ref_log_probs)
