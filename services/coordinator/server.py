"""The `rlfabric.v1.Coordinator` servicer: starts runs in a background thread, reports and streams them.

One coordinator process drives one run at a time (the sketch's "1 per run"); the run's state lives in the
Redis journal, so a restarted coordinator answers `GetRun` and `StreamMetrics` for earlier runs and
continues a stopped or crashed one with `StartRun(resume=true)`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.common.redis_store import RunJournal
from services.common.status import abort, echo

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Coordinator"

_PHASES = {
    "starting": coordinator_pb2.RUN_PHASE_STARTING,
    "running": coordinator_pb2.RUN_PHASE_ROLLOUT,
    "rollout": coordinator_pb2.RUN_PHASE_ROLLOUT,
    "iteration_done": coordinator_pb2.RUN_PHASE_UPDATE,
    "checkpoint": coordinator_pb2.RUN_PHASE_CHECKPOINT,
    "done": coordinator_pb2.RUN_PHASE_DONE,
    "stopped": coordinator_pb2.RUN_PHASE_STOPPED,
    "failed": coordinator_pb2.RUN_PHASE_FAILED,
}


_RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """`driver_factory(config_yaml, overrides, run_id) -> RunDriver` builds a driver (config errors raise ValueError)."""

    def __init__(self, redis_client: Any, driver_factory: Callable[[str, list[str], str], Any]) -> None:
        self.redis = redis_client
        self.driver_factory = driver_factory
        self._lock = threading.Lock()
        self._active: tuple[str, Any, threading.Thread] | None = None

    def _status(self, run_id: str) -> coordinator_pb2.RunStatus:
        state = RunJournal(self.redis, run_id).read()
        ckpt = state.get("checkpoint") or {}
        return coordinator_pb2.RunStatus(
            run_id=run_id, phase=_PHASES.get(state.get("phase", ""), coordinator_pb2.RUN_PHASE_UNSPECIFIED),
            iteration=int(state.get("iteration", 0)), total_iterations=int(state.get("train_iters", 0)),
            weights_version=int(state.get("weights_version", 0)), error=state.get("error", "") or "",
            checkpoint=ckpt.get("path", ""))

    def StartRun(self, request, context):
        run_id = request.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        if not _RUN_ID.fullmatch(run_id):  # it names a directory under --runs-dir: no '/', no '..'
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                          f"run_id {echo(run_id)} must be 1-128 letters, digits, '.', '_' or '-', not starting "
                          "with '.'")
        with self._lock:
            if self._active and self._active[2].is_alive():
                if self._active[0] == run_id:
                    return self._status(run_id)
                abort(context, grpc.StatusCode.ALREADY_EXISTS,
                              f"run {echo(self._active[0])} is active on this coordinator; stop it first")
            if RunJournal(self.redis, run_id).exists() and not request.resume:
                abort(context, grpc.StatusCode.ALREADY_EXISTS,
                              f"run {echo(run_id)} has a journal; pass resume=true to continue it")
            try:
                driver = self.driver_factory(request.config_yaml, list(request.overrides), run_id)
            except ValueError as e:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            driver.journal.write(phase="starting", error="")
            thread = threading.Thread(target=self._drive, args=(driver, request.resume), name=f"run-{run_id}",
                                      daemon=True)
            self._active = (run_id, driver, thread)
            thread.start()
        return self._status(run_id)

    @staticmethod
    def _drive(driver: Any, resume: bool) -> None:
        try:
            driver.run(resume=resume)
        except Exception:
            logger.exception("run %s failed", driver.run_id)

    def GetRun(self, request, context):
        if not RunJournal(self.redis, request.run_id).exists():
            abort(context, grpc.StatusCode.NOT_FOUND, f"no run {echo(request.run_id)}")
        return self._status(request.run_id)

    def StopRun(self, request, context):
        with self._lock:
            active = self._active
        if active and active[0] == request.run_id and active[2].is_alive():
            active[1].stop_event.set()
            active[2].join(timeout=max(1.0, context.time_remaining() or 60.0) - 0.5)
        elif not RunJournal(self.redis, request.run_id).exists():
            abort(context, grpc.StatusCode.NOT_FOUND, f"no run {echo(request.run_id)}")
        return self._status(request.run_id)

    def StreamMetrics(self, request, context):
        journal = RunJournal(self.redis, request.run_id)
        if not journal.exists():
            abort(context, grpc.StatusCode.NOT_FOUND, f"no run {echo(request.run_id)}")
        if request.from_iteration:
            next_it = request.from_iteration
        else:
            # From where this attempt of the run starts (a fresh run's is 0; a resumed one's is known once it
            # leaves "starting"), so that iterations it computes again are shown again.
            state = journal.read()
            while context.is_active() and state.get("phase") == "starting":
                time.sleep(0.2)
                state = journal.read()
            next_it = int(state.get("start_iteration", state.get("iteration", 0))) + 1
        while context.is_active():
            # Phase first: iterations journaled before a terminal phase are then all in `done`.
            finished = journal.read().get("phase") in ("done", "stopped", "failed")
            # Only the next iteration is read: reading every journaled iteration on each poll made a follower's
            # cost (and its hold on the coordinator's GIL) grow with the run's length.
            while (metrics := journal.iteration_metrics(next_it)) is not None:
                yield coordinator_pb2.IterationMetrics(
                    run_id=request.run_id, iteration=next_it, metrics=common_pb2.Metrics(values=metrics))
                next_it += 1
            if finished:
                return
            time.sleep(0.2)
