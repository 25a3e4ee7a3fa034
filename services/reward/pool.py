"""Process pool that runs verifications with per-sample deadlines and crash isolation.

Why processes: math-verify and sympy can hang or blow the stack on adversarial text, their own
`signal.alarm` timeouts do not work in gRPC threads, and a thread cannot be killed. Each pool process
serves one verification at a time over a pipe; a parent thread ("slot") per process waits for the verdict
until the sample's deadline. A verification that runs past it gets its process SIGKILLed and replaced; one
whose process dies (even `os._exit` or SIGKILL from inside) is reported as a crash; an exception or a
non-finite score is reported as such. In every case that sample scores 0 with an error, and the pool
keeps serving.

A slot hands its process every task already queued (up to its share) in one pipe message and reads
the verdicts one by one, so the pipe costs one pickle and one write per batch, not per sample, while
each verdict still has its own deadline. Every task carries an id and every verdict the id of its task:
a verdict left in the pipe by an earlier batch is discarded, never handed to the next sample, and a
process whose verdicts come out of order, or whose slot fails in any way, is replaced.

Processes come from a forkserver that has already imported and warmed the verifiers, so a replacement
starts in milliseconds and never inherits the parent's gRPC threads. As with any non-fork start method,
a script that creates a pool must guard its entry point with `if __name__ == "__main__":` (children
re-import the main module); `python -m ...` entry points and pytest are fine.
"""

import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from services.reward import metrics
from services.reward.outcome import CRASH, EXCEPTION, NON_FINITE, TIMEOUT, Outcome
from services.reward.pool_child import PING, child_main, load_plugin
from services.reward.verifiers.registry import VERIFIERS

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # first start imports sympy/math-verify in the forkserver
# Most tasks one pipe message carries. Small enough that a batch of slow verifications does not hold
# work another slot could take (a slot takes at most its share of the queue anyway).
_MAX_BATCH = 32
_MAX_POLL_MS = 2**31 - 1  # poll() takes a C int


class _OutOfOrderError(Exception):
    """The process answered a task of this batch other than the one awaited: its pipe cannot be trusted."""


class SampleClock:
    """The deadline of one sample: it starts when the first of its verifications starts running.

    Queueing time does not count (the client pool bounds in-flight work instead), so a burst of samples
    does not time out merely by waiting its turn.
    """

    def __init__(self, budget_s: float) -> None:
        if not math.isfinite(budget_s) or budget_s <= 0:
            raise ValueError(f"deadline budget must be a finite number of seconds > 0, got {budget_s}")
        self.budget_s = budget_s
        self._deadline: float | None = None
        self._lock = threading.Lock()

    def deadline(self) -> float:
        """Absolute `time.monotonic()` deadline, fixed on the first call."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self.budget_s
            return self._deadline


@dataclass
class _Task:
    """One queued verification. `start()` is False when its caller gave up on it (then `done(None)` is
    called, so the caller can account for it); otherwise `done(outcome)` is called exactly once."""

    task_id: int
    verifier: str
    response: str
    ground_truth: str
    clock: SampleClock
    start: Callable[[], bool]
    done: Callable[[Outcome | None], None]
    finished: bool = False

    def finish(self, outcome: Outcome | None) -> None:
        if not self.finished:
            self.finished = True
            self.done(outcome)


class _Slot:
    """One pool process and the parent thread that feeds it and enforces deadlines."""

    def __init__(self, index: int, pool: "VerifierPool") -> None:
        self.index = index
        self._pool = pool
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._poller: select.poll | None = None
        self.restarts = 0
        self._start_process()
        self._thread = threading.Thread(target=self._run, name=f"reward-pool-{index}", daemon=True)

    def _start_process(self) -> None:
        parent_conn, child_conn = self._pool._ctx.Pipe()
        process = self._pool._ctx.Process(
            target=child_main, args=(child_conn, dict(self._pool.plugins)), name=f"reward-verifier-{self.index}",
            daemon=True,
        )
        process.start()
        child_conn.close()  # so that the child's death reads as EOF here
        # One poll object per pipe: Connection.poll() builds a selector on every call.
        poller = select.poll()
        poller.register(parent_conn.fileno(), select.POLLIN)
        self._process, self._conn, self._poller = process, parent_conn, poller

    def wait_ready(self, timeout_s: float) -> None:
        try:
            self._conn.send(PING)
            if not self._conn.poll(timeout_s):
                raise RuntimeError(f"reward pool process {self.index} did not start within {timeout_s:.0f} s")
            self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"reward pool process {self.index} exited at start (exit code "
                               f"{self._exit_code()}); see its traceback above") from e

    def _replace_process(self, why: str) -> None:
        process = self._process
        if process is not None and process.is_alive():
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process is not None:
            process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self.restarts += 1
        metrics.PROCESS_RESTARTS.inc()
        logger.warning("reward pool process %d replaced (%s)", self.index, why)
        self._process, self._conn = None, None
        if not self._pool.closed:
            try:
                self._start_process()
            except Exception:
                logger.exception("could not start reward pool process %d", self.index)

    def _exit_code(self) -> int | None:
        if self._process is None:
            return None
        self._process.join(timeout=1)
        return self._process.exitcode

    def _run(self) -> None:
        tasks = self._pool._tasks
        while True:
            task = tasks.get()
            if task is None:
                return
            # Hand the child everything already queued (up to this slot's share) in one pipe message:
            # one pickle and one write per batch instead of per sample. Replies still come one per task.
            share = min(_MAX_BATCH, max(1, tasks.qsize() // len(self._pool._slots)))
            batch, stop = [task], False
            while len(batch) < share:
                try:
                    extra = tasks.get_nowait()
                except queue.Empty:
                    break
                if extra is None:
                    stop = True  # close(): finish this batch, then end
                    break
                batch.append(extra)
            metrics.QUEUE_DEPTH.set(tasks.qsize())
            runnable = []
            for t in batch:
                if t.start():
                    runnable.append(t)
                else:
                    t.finish(None)  # given up by its caller (a cancelled stream): not run
            if runnable:
                try:
                    self._verify_batch(runnable)
                except Exception as e:
                    logger.exception("reward pool slot %d failed on a batch of %d", self.index, len(runnable))
                    # Verdicts of this batch may still be on their way: a fresh process and pipe.
                    self._replace_process(f"slot error: {e}")
                    for t in runnable:
                        t.finish(Outcome.failed(CRASH, f"reward pool error: {e}", 0.0))
            if stop:
                return

    def _verify_batch(self, batch: list[_Task]) -> None:
        """Runs `batch` in order in the pool process; every task gets its Outcome.

        Each task's deadline clock starts when the previous task's verdict arrives (when it starts to
        run). A task that runs past its deadline, or whose process dies, costs only itself: the process
        is replaced and the rest of the batch is sent again to the new one.
        """
        pending = batch
        while pending:
            if self._process is None or not self._process.is_alive():
                self._replace_process("died while idle")  # not these samples' fault: a fresh process
                if self._process is None:
                    for task in pending:
                        task.finish(Outcome.failed(CRASH, "no verifier process could be started", 0.0))
                    return
            if pending[0].clock.deadline() <= time.monotonic():
                pending[0].finish(Outcome.failed(
                    TIMEOUT, "the sample's deadline passed before this verification started", 0.0))
                pending = pending[1:]
                continue
            try:
                self._conn.send([(t.task_id, t.verifier, t.response, t.ground_truth) for t in pending])
            except (OSError, BrokenPipeError):
                self._replace_process(f"died with exit code {self._exit_code()} while idle")
                continue
            pending = self._collect(pending)

    def _collect(self, pending: list[_Task]) -> list[_Task]:
        """Reads the verdicts of `pending` (just sent); returns the tasks to send again, if any."""
        batch_ids = {task.task_id for task in pending}
        for index, task in enumerate(pending):
            started = time.monotonic()
            try:
                reply = self._verdict(task, batch_ids)
            except _OutOfOrderError as e:
                self._replace_process(str(e))
                return pending[index:]  # nothing was lost but the pipe's order: send them again
            except (EOFError, OSError, BrokenPipeError):
                code = self._exit_code()
                self._replace_process(f"died with exit code {code} during {task.verifier}")
                task.finish(Outcome.failed(CRASH, f"verifier process died (exit code {code})",
                                           time.monotonic() - started))
                return pending[index + 1 :]
            elapsed = time.monotonic() - started
            if reply is None:
                self._replace_process(f"{task.verifier} ran past its deadline")
                task.finish(Outcome.failed(
                    TIMEOUT, f"no verdict within the {task.clock.budget_s:g} s sample deadline", elapsed))
                return pending[index + 1 :]
            kind, value = reply
            if kind == "ok":
                task.finish(Outcome(score=float(value), latency_s=elapsed))
            else:
                task.finish(
                    Outcome.failed(NON_FINITE if kind == "non_finite" else EXCEPTION, str(value), elapsed))
        return []

    def _verdict(self, task: _Task, batch_ids: set[int]) -> tuple[str, object] | None:
        """The (kind, value) verdict of `task`, or None when its deadline passes first."""
        deadline = task.clock.deadline()
        while True:
            timeout_ms = min(_MAX_POLL_MS, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
            if not self._poller.poll(timeout_ms):
                return None
            task_id, kind, value = self._conn.recv()
            if task_id == task.task_id:
                return kind, value
            if task_id in batch_ids:
                raise _OutOfOrderError(f"verdict of task {task_id} arrived while task {task.task_id} was awaited")
            logger.warning("reward pool process %d: discarded a stale verdict of task %s", self.index, task_id)


class VerifierPool:
    """Runs built-in (and plugin) verifiers in `processes` worker processes with deadlines.

    Args:
        processes: pool processes (one verification at a time each).
        plugins: extra verifiers, name -> "package.module:function" or "/path/file.py:function".
        start_method: multiprocessing start method; "forkserver" (default) keeps children free of the
            parent's threads and makes replacements cheap.
    """

    def __init__(self, processes: int = 1, *, plugins: Mapping[str, str] | None = None,
                 start_method: str = "forkserver") -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.plugins = dict(plugins or {})
        for name, spec in self.plugins.items():
            if name in VERIFIERS:
                raise ValueError(f"verifier plugin {name!r} would shadow the built-in verifier of that name")
            load_plugin(spec)  # fail here, with the spec named, rather than in every child
        self.closed = False
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(["services.reward.pool_preload"])
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._task_ids = itertools.count()
        self._slots = [_Slot(i, self) for i in range(processes)]
        for slot in self._slots:
            slot.wait_ready(_START_TIMEOUT_S)
        for slot in self._slots:
            slot._thread.start()

    @property
    def names(self) -> list[str]:
        """Verifier names this pool can run: built-ins, then plugins."""
        return [*VERIFIERS, *self.plugins]

    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def restarts(self) -> int:
        """Processes replaced so far (timeouts and crashes)."""
        return sum(slot.restarts for slot in self._slots)

    def queue_depth(self) -> int:
        return self._tasks.qsize()

    def submit(self, verifier: str, response: str, ground_truth: str, clock: SampleClock) -> "Future[Outcome]":
        """Queues one verification; the future always resolves to an Outcome (never raises)."""
        future: Future[Outcome] = Future()

        def done(outcome: Outcome | None) -> None:
            if outcome is not None:
                future.set_result(outcome)

        self.submit_callback(verifier, response, ground_truth, clock, done, future.set_running_or_notify_cancel)
        return future

    def submit_callback(self, verifier: str, response: str, ground_truth: str, clock: SampleClock,
                        done: Callable[[Outcome | None], None], start: Callable[[], bool] = lambda: True) -> None:
        """Queues one verification without a Future (the worker's hot path: a Future costs a Condition).

        `done(outcome)` is called exactly once from a pool thread, or `done(None)` when `start()` said
        no (the caller gave up on it before it ran).
        """
        if verifier not in VERIFIERS and verifier not in self.plugins:
            raise ValueError(f"unknown verifier {verifier!r}; this pool runs: {', '.join(self.names)}")
        if self.closed:
            raise RuntimeError("the verifier pool is closed")
        self._tasks.put(_Task(next(self._task_ids), verifier, response, ground_truth, clock, start, done))
        metrics.QUEUE_DEPTH.set(self._tasks.qsize())

    def verify(self, verifier: str, response: str, ground_truth: str, deadline_s: float) -> Outcome:
        """Blocking convenience: one verification with its own deadline."""
        return self.submit(verifier, response, ground_truth, SampleClock(deadline_s)).result()

    def close(self) -> None:
        """Stops the slots after the queued work and ends the processes."""
        if self.closed:
            return
        self.closed = True
        for _ in self._slots:
            self._tasks.put(None)
        for slot in self._slots:
            slot._thread.join(timeout=10)
            if slot._conn is not None:
                try:
                    slot._conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
            if slot._process is not None:
                slot._process.join(timeout=5)
                if slot._process.is_alive():
                    slot._process.kill()
                    slot._process.join(timeout=5)

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
