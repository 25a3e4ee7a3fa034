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


def test_batched_samples_around_a_hang_and_a_crash_keep_their_verdicts(faulty_plugins):
    # One process, everything queued at once: the slot hands the process batches of queued samples.
    # A hang and a crash in the middle of a batch cost only themselves; the rest of the batch is sent
    # again to the replacement process and scored as usual, in one piece.
    with VerifierPool(1, plugins=faulty_plugins) as single:
        plan = [("sleep_forever", f"{i}", "3") for i in range(25)]
        plan[7] = ("sleep_forever", "hang", "x")
        plan[15] = ("kill_process", "kill", "x")
        plan[20] = ("raise_error", "raise", "x")
        futures = [single.submit(name, response, label, SampleClock(1.0)) for name, response, label in plan]
        outcomes = [f.result(timeout=60) for f in futures]
        expected_reasons = ["" for _ in plan]
        expected_reasons[7], expected_reasons[15], expected_reasons[20] = TIMEOUT, CRASH, EXCEPTION
        assert [o.reason for o in outcomes] == expected_reasons
        expected_scores = [1.0 if i == 3 else 0.0 for i in range(25)]
        expected_scores[20] = 0.0
        assert [o.score for o in outcomes] == expected_scores
        assert single.restarts == 2  # the hang and the crash, nothing else


def test_submit_callback_reports_every_task_once_and_skips_given_up_ones(pool):
    # The worker's hot path: no Future; `done` gets the outcome once, or None for a task whose caller
    # gave up (a cancelled stream) before it ran, which is then never run.
    import threading

    calls: dict[int, list] = {i: [] for i in range(10)}
    all_done = threading.Event()
    lock = threading.Lock()

    def done_for(i):
        def done(outcome):
            with lock:
                calls[i].append(outcome)
                if all(calls.values()):
                    all_done.set()
        return done

    for i in range(10):
        pool.submit_callback("sleep_forever", "hang" if i % 2 else str(i), "4", SampleClock(1.0), done_for(i),
                             start=lambda i=i: i % 2 == 0)  # the odd ones would hang: they are given up
    assert all_done.wait(30)
    assert all(len(outcomes) == 1 for outcomes in calls.values())
    assert [calls[i][0] is None for i in range(10)] == [i % 2 == 1 for i in range(10)]
    assert [calls[i][0].score for i in range(0, 10, 2)] == [1.0 if i == 4 else 0.0 for i in range(0, 10, 2)]
