"""Prometheus collectors of a tool server (served on its `/metrics` endpoint); labels are tool names only.

Calls/s is `rate(rlfabric_tool_calls_total[1m])`, the error share the `status` label's split of it.
"""

import math

from prometheus_client import Counter, Gauge, Histogram

CALLS = Counter("rlfabric_tool_calls_total", "Tool calls answered, by tool and status (ok, tool_error, timeout, "
                                             "invalid_arguments)", ["tool", "status"])
LATENCY = Histogram(
    "rlfabric_tool_call_seconds", "Wall seconds per tool call, waiting for a worker included", ["tool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, math.inf),
)
IN_FLIGHT = Gauge("rlfabric_tool_calls_in_flight", "Tool calls received and not yet answered", ["tool"])
RUNNING = Gauge("rlfabric_tool_calls_running", "Tool calls holding a worker (at most num_workers)", ["tool"])


def record_call(tool: str, status: str, latency_s: float) -> None:
    """Counts one answered call; `status` is the Status value, lower-cased in the label."""
    CALLS.labels(tool, status.lower()).inc()
    LATENCY.labels(tool).observe(latency_s)
