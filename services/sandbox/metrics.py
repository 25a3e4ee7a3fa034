"""Prometheus collectors of the sandbox service (served on its own `/metrics` path).

runs/s is `rate(rlfabric_sandbox_runs_total[1m])`; the outcome label has a handful of values, no per-run labels.
"""

import math

from prometheus_client import Counter, Gauge, Histogram

RUNS = Counter(
    "rlfabric_sandbox_runs_total", "Runs finished, by outcome: success, failed (non-zero exit), timeout, "
    "output_limit, scratch_limit, sandbox_error (refused or could not run)", ["outcome"],
)
RUN_SECONDS = Histogram(
    "rlfabric_sandbox_run_seconds", "Wall seconds per run, sandbox set-up included",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf),
)
REFUSED = Counter(
    "rlfabric_sandbox_refused_total", "Requests not run: queue_full, queue_timeout, bad_request", ["reason"],
)
QUEUE_DEPTH = Gauge("rlfabric_sandbox_queue_depth", "Requests waiting for a start token or a worker slot")
IN_FLIGHT = Gauge("rlfabric_sandbox_runs_in_flight", "Runs holding a worker slot")
