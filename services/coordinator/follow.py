"""The client side of a run: start it on a coordinator and print its iterations until it ends, or stop it.

Used by `rlfabric train` (a coordinator somewhere) and `rlfabric up` (one it started itself).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import grpc

from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.client import make_channel
from services.common.deadlines import DEFAULT_DEADLINE_S, START_RUN_DEADLINE_S, STOP_RUN_DEADLINE_S
from services.coordinator.sinks import ConsoleSink

FINISHED_OK = (coordinator_pb2.RUN_PHASE_DONE, coordinator_pb2.RUN_PHASE_STOPPED)


def start_and_follow(address: str, request: coordinator_pb2.StartRunRequest, *, total: int | None = None,
                     on_started: Callable[[str], None] | None = None,
                     after_iteration: Callable[[int], None] | None = None,
                     full_metrics: bool = False,
                     on_iteration: Callable[[int], None] | None = None) -> coordinator_pb2.RunStatus:
    """StartRun, then one console line per finished iteration; returns the final status (gRPC errors propagate).

    Args:
        total: train_iters, shown as "iteration k/total".
        on_started: called with the run id once the coordinator accepted the run.
        after_iteration: called with each printed iteration (e.g. to check that local services still live).
        on_iteration: called with each iteration just before its line is printed (what Ctrl-C reports as the last
            iteration logged: counted before the line, a Ctrl-C right after the line cannot miss it).
        full_metrics: print every metric of an iteration instead of the short line.
    """
    with make_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        status = stub.StartRun(request, timeout=START_RUN_DEADLINE_S)
        if on_started is not None:
            on_started(status.run_id)
        print(f"run {status.run_id} started (the coordinator syncs the replicas' weights first); every "
              "metric goes to the run's metrics.jsonl", flush=True)
        sink = ConsoleSink(total=total, full=full_metrics)
        streamed = 0
        for m in stub.StreamMetrics(coordinator_pb2.StreamMetricsRequest(run_id=status.run_id)):
            streamed += 1
            if on_iteration is not None:  # before the line: a Ctrl-C right after it must find it counted
                on_iteration(m.iteration)
            sink.write(m.iteration, dict(m.metrics.values))
            if after_iteration is not None:
                after_iteration(m.iteration)
        final = stub.GetRun(coordinator_pb2.GetRunRequest(run_id=status.run_id), timeout=DEFAULT_DEADLINE_S)
    phase = coordinator_pb2.RunPhase.Name(final.phase)
    print(f"run {final.run_id}: {phase} at iteration {final.iteration}" + (f": {final.error}" if final.error else ""),
          flush=True)
    if not streamed and final.phase == coordinator_pb2.RUN_PHASE_DONE and final.iteration >= final.total_iterations:
        print(nothing_to_train(final), flush=True)
    return final


def nothing_to_train(final: coordinator_pb2.RunStatus) -> str:
    """Why a run ended without training: a second `rlfabric train` on a running system starts where the actor is."""
    return (f"nothing to train: the actor trainer already holds iteration {final.iteration} and "
            f"megatron_training.train_iters is {final.total_iterations} (a run continues from the iteration the "
            f"actor holds); to train on, pass -o megatron_training.train_iters=N with N > {final.iteration}")


def stop_after_interrupt(address: str, run_id: str, last_logged: int | None = None,
                         ) -> coordinator_pb2.RunStatus | None:
    """Ctrl-C while following a run: StopRun (the run stops after its current phase), then say where it stopped.

    A second Ctrl-C leaves at once; the coordinator set the run's stop flag as the StopRun arrived, so the run
    stops either way. `last_logged` is the last iteration the console printed (it can trail the journal's by
    the one the coordinator finished while stopping). Returns the run's status, None when it is unknown.
    """
    print(f"interrupted: stopping run {run_id} after its current phase (Ctrl-C again to leave now; it stops "
          "anyway)", file=sys.stderr, flush=True)
    try:
        with make_channel(address) as channel:
            status = coordinator_pb2_grpc.CoordinatorStub(channel).StopRun(
                coordinator_pb2.StopRunRequest(run_id=run_id), timeout=STOP_RUN_DEADLINE_S)
    except KeyboardInterrupt:
        print(f"left run {run_id} stopping on the coordinator", file=sys.stderr, flush=True)
        return None
    except grpc.RpcError as e:
        print(f"error: StopRun of {run_id}: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)
        return None
    logged = f"; the last iteration logged here: {last_logged}" if last_logged is not None else ""
    where = "stopped" if status.phase == coordinator_pb2.RUN_PHASE_STOPPED else \
        f"still {coordinator_pb2.RunPhase.Name(status.phase)} after {STOP_RUN_DEADLINE_S:.0f} s,"
    of = f" of {status.total_iterations}" if status.total_iterations else ""
    print(f"run {run_id} {where} at iteration {status.iteration}{of}{logged}"
          + (f"; latest checkpoint {status.checkpoint}" if status.checkpoint else ""), file=sys.stderr, flush=True)
    return status
