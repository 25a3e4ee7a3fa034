"""Reward arithmetic on a worker, as MindSpeed-RL defines it: weighted sum and DAPO overlong shaping.

- final reward = sum_i `verifier_weight[i]` * score_i (over `rl_config.verifier_function`);
- DAPO overlong shaping (`overlong_buffer_enable`): expected = `rollout_max_tokens` - `overlong_buffer`,
  exceed = min(length - expected, `overlong_buffer`), penalty = min(-exceed / buffer * factor, 0),
  added to the reward (only when the worker is started with `--overlong-buffer`; the coordinator applies the
  run's shaping itself, services/coordinator/advantages.py).
The per-verifier means (`{name}_rewards/mean`) are the coordinator's (services/coordinator/iteration_metrics.py).
Pure functions, no I/O.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO overlong shaping (`rl_config.overlong_buffer*`, `rl_config.rollout_max_tokens`)."""

    rollout_max_tokens: int
    overlong_buffer: int
    overlong_buffer_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.overlong_buffer < self.rollout_max_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be > 0 and < rollout_max_tokens "
                f"({self.rollout_max_tokens})"
            )


def overlong_penalty(response_length: int, config: OverlongConfig) -> float:
    """Penalty (<= 0) for a response of `response_length` tokens; 0 up to the expected length."""
    expected = config.rollout_max_tokens - config.overlong_buffer
    exceed = min(response_length - expected, config.overlong_buffer)
    return min(-exceed / config.overlong_buffer * config.overlong_buffer_penalty_factor, 0.0)


def weighted_reward(scores: Sequence[float], weights: Sequence[float]) -> float:
    """sum(weight * score); the two sequences must have equal lengths."""
    if len(scores) != len(weights):
        raise ValueError(f"{len(scores)} scores but {len(weights)} weights: verifier_function and "
                         "verifier_weight must have equal lengths")
    return float(sum(w * s for w, s in zip(weights, scores, strict=True)))
