"""The client side of a run: start it on a coordinator and print its iterations until it ends.

Used by `rlfabric train` (a coordinator somewhere) and `rlfabric up` (one it started itself).
"""

from __future__ import annotations

from collections.abc import Callable

from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.client import make_channel
from services.coordinator.sinks import ConsoleSink

FINISHED_OK = (coordinator_pb2.RUN_PHASE_DONE, coordinator_pb2.RUN_PHASE_STOPPED)


def start_and_follow(address: str, request: coordinator_pb2.StartRunRequest, *, total: int | None = None,
                     on_started: Callable[[str], None] | None = None,
                     after_iteration: Callable[[], None] | None = None,
                     full_metrics: bool = False) -> coordinator_pb2.RunStatus:
    """StartRun, then one console line per finished iteration; returns the final status (gRPC errors propagate).

    Args:
        total: train_iters, shown as "iteration k/total".
        on_started: called with the run id once the coordinator accepted the run.
        after_iteration: called after each printed iteration (e.g. to check that local services still live).
        full_metrics: print every metric of an iteration instead of the short line.
    """
    with make_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        status = stub.StartRun(request, timeout=600)
        if on_started is not None:
            on_started(status.run_id)
        print(f"run {status.run_id} started (the coordinator syncs the replicas' weights first); every "
              "metric goes to the run's metrics.jsonl", flush=True)
        sink = ConsoleSink(total=total, full=full_metrics)
        for m in stub.StreamMetrics(coordinator_pb2.StreamMetricsRequest(run_id=status.run_id)):
            sink.write(m.iteration, dict(m.metrics.values))
            if after_iteration is not None:
                after_iteration()
        final = stub.GetRun(coordinator_pb2.GetRunRequest(run_id=status.run_id), timeout=30)
    phase = coordinator_pb2.RunPhase.Name(final.phase)
    print(f"run {final.run_id}: {phase} at iteration {final.iteration}" + (f": {final.error}" if final.error else ""),
          flush=True)
    return final
