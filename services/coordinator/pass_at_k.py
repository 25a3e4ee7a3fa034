"""pass@k, its unbiased estimator, and mean@n: the accuracy figures of `rlfabric eval` and of validation.

For one problem with n samples of which c are correct, the chance that at least one of k samples drawn
without replacement from the n is correct is (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code", https://arxiv.org/abs/2107.03374, eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)          (1 when n - c < k)

an unbiased estimate of the probability that k fresh samples contain a correct one; it is computed as the
product 1 - prod_{i = n-c+1..n} (1 - k / i), which never forms the huge binomials. A dataset's pass@k is
the mean over its problems. pass@1 = c / n. mean@n is the mean score of all n samples, for verifiers
whose scores are not 0/1 as well.

A sample is correct when its score reaches `threshold` (1.0 by default: the full score of every
built-in 1/0 and +1/-x rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` correct out of `n` samples; needs 1 <= k <= n."""
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must be in 0..n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in 1..n={n} (draw at least k samples per problem)")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def dataset_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """Mean pass@k over problems, `correct[i]` of `n` samples of problem i being correct."""
    if not correct:
        raise ValueError("no problems")
    return float(np.mean([pass_at_k(n, c, k) for c in correct]))


def summarize(scores: Sequence[Sequence[float]], ks: Sequence[int], threshold: float = 1.0) -> dict[str, float]:
    """Per-dataset figures from each problem's sample scores (every problem has the same n samples).

    Returns `pass@{k}` for each k in `ks` (k <= n), `mean@{n}` and `problems`.
    """
    if not scores:
        raise ValueError("no problems")
    n = len(scores[0])
    if n == 0 or any(len(s) != n for s in scores):
        raise ValueError(f"every problem needs the same number of samples (the first has {n})")
    correct = [sum(1 for x in s if x >= threshold) for s in scores]
    out = {f"pass@{k}": dataset_pass_at_k(correct, n, k) for k in sorted(set(ks))}
    out[f"mean@{n}"] = float(np.mean([np.mean(s) for s in scores]))
    out["problems"] = float(len(scores))
    return out
