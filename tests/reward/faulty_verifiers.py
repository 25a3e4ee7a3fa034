"""Verifiers that misbehave on purpose, loaded into reward pools as plugins by the tests.

Each one fails only when the response says so, so a test can mix good and bad samples in one stream.
"""

import math
import os
import signal
import time


def sleep_forever(response: str, ground_truth: str) -> float:
    """Hangs (as a stuck sympy call would) when the response contains "hang"."""
    if "hang" in response:
        time.sleep(3600)
    return 1.0 if response.strip() == ground_truth else 0.0


def raise_error(response: str, ground_truth: str) -> float:
    """Raises when the response contains "raise"."""
    if "raise" in response:
        raise RuntimeError("verifier bug triggered on purpose")
    return 1.0


def return_nan(response: str, ground_truth: str) -> float:
    """Returns NaN (or inf) when the response says so."""
    if "nan" in response:
        return math.nan
    if "inf" in response:
        return math.inf
    return 1.0


def kill_process(response: str, ground_truth: str) -> float:
    """Kills its own process (as a segfault in a C extension would) when the response contains "kill"."""
    if "kill" in response:
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def sleepy(response: str, ground_truth: str) -> float:
    """`"SECONDS:ANSWER"`: sleeps that long (a slow verification), then 1.0 iff ANSWER is the label."""
    seconds, _, answer = response.partition(":")
    time.sleep(float(seconds))
    return 1.0 if answer == ground_truth else 0.0
