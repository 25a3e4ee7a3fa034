"""The process pool: hangs, exceptions, non-finite scores and process deaths cost one sample each."""

import time

import pytest

from services.reward.outcome import CRASH, EXCEPTION, NON_FINITE, TIMEOUT
from services.reward.pool import SampleClock, VerifierPool


@pytest.fixture(scope="module")
def pool(faulty_plugins):
    with VerifierPool(2, plugins=faulty_plugins) as pool:
        yield pool


def test_builtin_scores(pool):
    assert pool.verify("math_equiv", "so \\boxed{\\frac{1}{2}}", "0.5", 10.0).score == 1.0
    outcome = pool.verify("acc", "no box", "1", 10.0)
    assert (outcome.score, outcome.reason, outcome.error) == (-1.0, "", "")


@pytest.mark.parametrize(("verifier", "response", "reason", "error_part"), [
    ("sleep_forever", "hang", TIMEOUT, "no verdict within the 1 s sample deadline"),
    ("raise_error", "raise", EXCEPTION, "RuntimeError: verifier bug triggered on purpose"),
    ("return_nan", "nan", NON_FINITE, "nan"),
    ("return_nan", "inf", NON_FINITE, "inf"),
    ("kill_process", "kill", CRASH, "exit code -9"),
])
def test_failure_costs_only_that_sample(pool, verifier, response, reason, error_part):
    bad = pool.submit(verifier, response, "x", SampleClock(1.0))
    good = [pool.submit("math_equiv", f"\\boxed{{{i}}}", "3", SampleClock(10.0)) for i in range(20)]
    outcome = bad.result(timeout=30)
    assert (outcome.score, outcome.reason) == (0.0, reason)
    assert error_part in outcome.error
    assert [f.result(timeout=30).score for f in good] == [1.0 if i == 3 else 0.0 for i in range(20)]
    # The pool keeps serving with the same number of processes afterwards.
    assert pool.verify(verifier, "fine", "fine", 10.0).score == 1.0
    assert pool.size == 2


def test_hanging_samples_finish_within_the_deadline_budget(pool):
    # 4 hanging samples on 2 processes with a 1 s deadline: two rounds of ~1 s, never the 3600 s sleep.
    started = time.monotonic()
    futures = [pool.submit("sleep_forever", "hang", "x", SampleClock(1.0)) for _ in range(4)]
    futures += [pool.submit("sleep_forever", "ok", "ok", SampleClock(1.0)) for _ in range(4)]
    outcomes = [f.result(timeout=60) for f in futures]
    assert [o.reason for o in outcomes] == [TIMEOUT] * 4 + [""] * 4
    assert [o.score for o in outcomes] == [0.0] * 4 + [1.0] * 4
    assert time.monotonic() - started < 30  # generous: a budget, not a speed claim


def test_unknown_verifier_and_bad_plugin(pool):
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        pool.submit("nope", "", "", SampleClock(1.0))
    with pytest.raises(ValueError, match="could not be loaded"):
        VerifierPool(1, plugins={"bad": "/nonexistent/file.py:fn"})
    with pytest.raises(ValueError, match="shadow the built-in"):
        VerifierPool(1, plugins={"acc": "os:getcwd"})
