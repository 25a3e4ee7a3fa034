"""pass@k's unbiased estimator and mean@n, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from services.coordinator.pass_at_k import dataset_pass_at_k, pass_at_k, summarize


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (2, 1, 1, 0.5),            # 1 - C(1,1)/C(2,1) = 1 - 1/2
    (8, 3, 1, 3 / 8),          # pass@1 is c/n
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 11 / 12),       # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (4, 0, 2, 0.0),            # nothing correct: no k-subset has a correct sample
    (4, 4, 4, 1.0),            # everything correct
    (4, 3, 2, 1.0),            # n - c = 1 < k = 2: every 2-subset holds a correct one
    (16, 1, 16, 1.0),          # k = n draws the correct one for sure
])
def test_pass_at_k_hand_worked(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_definition_on_a_grid() -> None:
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_dataset_pass_at_k_is_the_mean_over_problems() -> None:
    # Problems with 1, 0 and 2 correct of 2: pass@1 = (0.5 + 0 + 1) / 3, pass@2 = (1 + 0 + 1) / 3.
    assert dataset_pass_at_k([1, 0, 2], 2, 1) == pytest.approx(0.5)
    assert dataset_pass_at_k([1, 0, 2], 2, 2) == pytest.approx(2 / 3)


def test_summarize_pass_and_mean() -> None:
    scores = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    out = summarize(scores, ks=[1, 2])
    assert out == {"pass@1": pytest.approx(0.5), "pass@2": pytest.approx(2 / 3), "mean@2": pytest.approx(0.5),
                   "problems": 3.0}


def test_summarize_threshold_and_graded_scores() -> None:
    # `acc`-style scores: +1 correct, -0.5 wrong. Correct means reaching the threshold (1.0);
    # mean@2 averages the raw scores: ((1 - 0.5) / 2 + (-0.5 - 0.5) / 2) / 2 = (0.25 - 0.5) / 2.
    out = summarize([[1.0, -0.5], [-0.5, -0.5]], ks=[1])
    assert out["pass@1"] == pytest.approx(0.25)
    assert out["mean@2"] == pytest.approx(-0.125)


def test_summarize_needs_the_same_n_everywhere() -> None:
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([[1.0, 0.0], [1.0]], ks=[1])
