"""The critic's loss for PPO: the clipped value loss of one micro-batch, and the metrics it logs.

As MindSpeed-RL (commit 05a90d7) defines it in `mindspeed_rl/models/loss/critic_loss_func.py`
(`CriticLossFunc._compute_value_loss`, the `ray_ppo` critic loss)::

    vclip_t  = clamp(vpred_t, V_t - cliprange_value, V_t + cliprange_value)
    loss     = 0.5 * token_mean(max((vpred_t - R_t)^2, (vclip_t - R_t)^2))      over the micro-batch's response tokens
    clipfrac = token_mean((vclip_t - R_t)^2 > (vpred_t - R_t)^2)

V are the values the critic gave at rollout time, R the GAE returns (services/coordinator/gae.py), vpred the critic's
values now. tests/trainer/test_value_loss.py checks loss, clipfrac and the gradient against upstream's function run
on the same inputs (tests/mindspeed_expected.py), maximum difference 0. verl's `compute_value_loss` (token-mean) is
the same formula and gives the same numbers, recorded beside them, with one exception: upstream squeezes vpred with
a bare `squeeze()`, so a micro-batch whose responses are all one token long (`[B, 1]`) broadcasts into a `[B, B]`
matrix (a clipfrac above 1 is possible); rlfabric takes `[B, T]` or `[B, T, 1]` and computes what verl computes there.
The critic's update (services/trainer/critic.py) calls it on each micro-batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

VALUE_LOSS_METRICS = ("critic/vf_loss", "critic/vf_clipfrac")  # upstream's names; vf_loss is logged as |loss|


def value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, response_mask: Tensor,
               cliprange_value: float) -> tuple[Tensor, float]:
    """(loss, clipfrac) of one micro-batch; the gradient flows through `vpreds` only.

    Args:
        vpreds: `[batch, seq]` (or `[batch, seq, 1]`, a value head's output) the critic's current values.
        returns: `[batch, seq]` GAE returns (no gradient).
        values: `[batch, seq]` the critic's values when the rollout was scored (no gradient).
        response_mask: `[batch, seq]` 0/1 or bool, the tokens that train.
        cliprange_value: `rl_config.cliprange_value` (upstream default 0.5), >= 0.

    Returns:
        The 0-dim loss in vpreds' dtype, and the fraction of masked tokens whose clipped loss is the larger, computed
        in float32 as upstream computes it. An empty mask gives loss 0 and clipfrac 0 (upstream's 1e-8 denominator).
    """
    if cliprange_value < 0:
        raise ValueError(f"rl_config.cliprange_value must be >= 0, got {cliprange_value}")
    if vpreds.dim() == 3 and vpreds.shape[-1] == 1:
        vpreds = vpreds.squeeze(-1)
    if not vpreds.shape == returns.shape == values.shape == response_mask.shape:
        raise ValueError(f"value loss shapes differ: vpreds {tuple(vpreds.shape)}, returns {tuple(returns.shape)}, "
                         f"values {tuple(values.shape)}, response_mask {tuple(response_mask.shape)}")
    returns, values = returns.detach(), values.detach()
    mask = response_mask.bool()
    # Upstream's mask is int64, so its count + 1e-8 is a float32: the count itself for any count >= 1.
    count = float(np.float32(int(mask.sum()) + 1e-8))
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_sq = (vpreds - returns) ** 2
    clipped_sq = (clipped - returns) ** 2
    loss = 0.5 * (torch.where(mask, torch.max(unclipped_sq, clipped_sq), 0.0).sum() / count)
    larger = int(torch.logical_and(clipped_sq > unclipped_sq, mask).sum())
    clipfrac = float(np.float32(larger) / np.float32(count))
    return loss, clipfrac


def value_loss_metrics(loss: Tensor, clipfrac: float) -> dict[str, float]:
    """The critic's per-micro-batch metrics under upstream's names."""
    return {VALUE_LOSS_METRICS[0]: abs(float(loss.detach().item())), VALUE_LOSS_METRICS[1]: clipfrac}
