"""The thread that drives a stepped engine: commands run between two steps, never during one.

`EngineThread` builds its engine on a thread of its own and only ever touches it from there. The thread runs
every queued command (`_call`), then one `_step` while there is work, and again; so whatever a command does
(admit or abort requests, apply weights, sleep) happens between two steps. `close` queues a sentinel behind
the commands already queued: the thread runs them, then `_shutdown`, and ends.

Admission window: a client sends a batch of groups as a stream, and their samples reach the engine thread one
by one. When the engine goes from idle to generating, it waits for the rest of the batch (while the next sample
arrives within ADMISSION_GAP_S, at most ADMISSION_WINDOW_S in all) before its first step, so the batch starts
together: a sample that missed the first step finishes one step after the others and adds a whole step to the
batch (measured on the demo's 8 x 8 x 8-token rollout: 9.0 steps on average instead of 8). A lone request waits
ADMISSION_GAP_S at most.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

ADMISSION_GAP_S = 0.002  # see "Admission window" above
ADMISSION_WINDOW_S = 0.02


class EngineUnavailableError(RuntimeError):
    """The engine cannot take the call now (closed, asleep, or its weights are invalid); the message says why."""


class EngineThread(abc.ABC):
    """Runs `_build`, then the command loop, on a thread of its own (see module docstring)."""

    def _start(self, name: str) -> None:
        """Starts the thread and returns once `_build` is done (raising what it raised)."""
        self._commands: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._closed = False
        self._close_lock = threading.Lock()  # nothing is queued behind close()'s sentinel (see _queue)
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.result()

    @abc.abstractmethod
    def _build(self) -> None:
        """Builds the engine (on the thread)."""

    @abc.abstractmethod
    def _busy(self) -> bool:
        """Whether there is work to step."""

    @abc.abstractmethod
    def _step(self) -> None:
        """One step of the engine."""

    @abc.abstractmethod
    def _step_failed(self, error: Exception) -> None:
        """After `_step` raised `error` (logged already)."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Stops the engine, after every command queued before `close`."""

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stops the engine within `timeout_s` (True: its thread stopped). That thread runs what was queued
        before, then `_shutdown`; later calls fail."""
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._commands.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():  # a daemon thread: left behind, it does not keep the process up
            logger.error("the engine thread did not stop within %.0f s; leaving it behind", timeout_s)
        return not self._thread.is_alive()

    def _call(self, fn: Callable[[], Any], wait: bool = True) -> Any:
        """Runs `fn` on the thread between two steps: its result (or exception), or, without `wait`, None
        at once (a failure is logged)."""
        future: Future = Future()
        if not wait:
            future.add_done_callback(_log_failure)
        self._queue(fn, future)
        return future.result() if wait else None

    def _queue(self, fn: Callable[[], Any], future: Future) -> Future:
        """Queues `fn`, whose outcome goes to `future`; commands run in the order they were queued."""
        # Under close()'s lock: a command queued behind the sentinel would never run, its caller never return.
        with self._close_lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            self._commands.put((fn, future))
        return future

    # --- on the thread -----------------------------------------------------------------------------------

    def _run(self, ready: Future) -> None:
        try:
            self._build()
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor
            ready.set_exception(e)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        while True:
            idle = not self._busy()
            try:
                # Block while idle; while generating, only drain what is already queued.
                item = self._commands.get(block=idle)
            except queue.Empty:
                item = ()
            window_end = None
            while item != ():
                if item is None:
                    self._shutdown()
                    return
                fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
                if window_end is None and idle and self._busy():
                    window_end = time.monotonic() + ADMISSION_WINDOW_S
                item = self._next_command(window_end)
            if self._busy():
                try:
                    self._step()
                except Exception as e:
                    logger.exception("engine step failed")
                    self._step_failed(e)

    def _next_command(self, window_end: float | None) -> Any:
        """The next queued command, or () when none is; within an admission window (`window_end`), waits
        up to ADMISSION_GAP_S for one."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            pass
        remaining = window_end - time.monotonic() if window_end is not None else 0.0
        if remaining <= 0:
            return ()
        try:
            return self._commands.get(timeout=min(ADMISSION_GAP_S, remaining))
        except queue.Empty:
            return ()


def _log_failure(future: Future) -> None:
    if future.exception() is not None:
        logger.error("engine command failed", exc_info=future.exception())
