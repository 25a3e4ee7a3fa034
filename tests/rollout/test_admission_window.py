"""The engine thread's admission window (services/rollout/engine_thread.py): samples that arrive one by one right
after the engine went busy join its first step; the wait is bounded."""

from __future__ import annotations

import queue
import threading
import time

from services.rollout.engine import RolloutEngine
from services.rollout.engine_thread import ADMISSION_GAP_S


def _engine_with_queue() -> RolloutEngine:
    eng = RolloutEngine.__new__(RolloutEngine)  # no vLLM: only the command queue is exercised
    eng._commands = queue.Queue()
    return eng


def test_commands_arriving_within_the_gap_are_taken_before_the_step() -> None:
    eng = _engine_with_queue()
    window_end = time.monotonic() + 10.0

    def feed() -> None:
        for i in range(5):
            time.sleep(ADMISSION_GAP_S / 10)
            eng._commands.put(("cmd", i))

    feeder = threading.Thread(target=feed)
    feeder.start()
    taken = []
    while (item := eng._next_command(window_end)) != ():
        taken.append(item[1])
    feeder.join()
    assert taken == [0, 1, 2, 3, 4]


def test_without_a_window_only_queued_commands_are_taken() -> None:
    eng = _engine_with_queue()
    eng._commands.put(("cmd", 0))
    assert eng._next_command(None) == ("cmd", 0)
    assert eng._next_command(None) == ()
    assert eng._next_command(time.monotonic() - 1) == ()  # a window that ended waits for nothing


def test_the_window_waits_at_most_the_gap_for_a_command_that_never_comes() -> None:
    eng = _engine_with_queue()
    started = time.monotonic()
    assert eng._next_command(time.monotonic() + 10.0) == ()
    assert 0.9 * ADMISSION_GAP_S <= time.monotonic() - started < 5.0
