"""The final reward of a sample, as MindSpeed-RL defines it: sum_i `verifier_weight[i]` * score_i.

The worker computes it for every `ScoreResponse` (`scoring.py`). DAPO overlong shaping is the run's,
applied by the coordinator (services/coordinator/advantages.py); the per-verifier means
(`{name}_rewards/mean`) are the coordinator's too (services/coordinator/iteration_metrics.py).
"""

from collections.abc import Sequence


def weighted_reward(scores: Sequence[float], weights: Sequence[float]) -> float:
    """sum(weight * score); the two sequences must have equal lengths."""
    if len(scores) != len(weights):
        raise ValueError(f"{len(scores)} scores but {len(weights)} weights: verifier_function and "
                         "verifier_weight must have equal lengths")
    return float(sum(w * s for w, s in zip(weights, scores, strict=True)))
