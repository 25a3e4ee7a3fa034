"""Reward arithmetic, as MindSpeed-RL defines it: weighted sum, DAPO overlong shaping, per-verifier means.

- final reward = sum_i `verifier_weight[i]` * score_i (over `rl_config.verifier_function`);
- DAPO overlong shaping (`overlong_buffer_enable`): expected = `rollout_max_tokens` - `overlong_buffer`,
  exceed = min(length - expected, `overlong_buffer`), penalty = min(-exceed / buffer * factor, 0),
  added to the reward;
- each verifier's scores are logged as `{name}_rewards/mean`.
Pure functions, no I/O.
"""

from collections.abc import Mapping, Sequence
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


def overlong_config_from_rl_config(rl_config: object) -> OverlongConfig | None:
    """The shaping settings of an `rl_config` section, or None when `overlong_buffer_enable` is off."""
    if not getattr(rl_config, "overlong_buffer_enable", False):
        return None
    return OverlongConfig(
        rollout_max_tokens=int(rl_config.rollout_max_tokens),
        overlong_buffer=int(rl_config.overlong_buffer),
        overlong_buffer_penalty_factor=float(rl_config.overlong_buffer_penalty_factor),
    )


def verifier_specs(rl_config: object) -> list[tuple[str, float]]:
    """(name, weight) pairs from `rl_config.verifier_function` / `rl_config.verifier_weight`."""
    names = list(getattr(rl_config, "verifier_function", None) or [])
    weights = list(getattr(rl_config, "verifier_weight", None) or [])
    if len(names) != len(weights):
        raise ValueError(f"rl_config.verifier_function has {len(names)} entries but rl_config.verifier_weight has "
                         f"{len(weights)}: give one weight per verifier")
    return [(str(name), float(weight)) for name, weight in zip(names, weights, strict=True)]


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


def reward_means(scores_by_verifier: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """`{name}_rewards/mean` for each verifier with at least one score."""
    return {f"{name}_rewards/mean": sum(s) / len(s) for name, s in scores_by_verifier.items() if len(s)}
