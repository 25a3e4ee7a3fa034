"""Prometheus collectors of a reward worker (served on its `/metrics` endpoint).

scores/s is `rate(rlfabric_reward_scores_total[1m])`; no per-sample labels, only verifier names.
"""

import math

from prometheus_client import Counter, Gauge, Histogram

SCORES = Counter("rlfabric_reward_scores_total", "Verifications finished (any outcome)", ["verifier"])
LATENCY = Histogram(
    "rlfabric_reward_verification_seconds", "Wall seconds per verification", ["verifier"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, math.inf),
)
TIMEOUTS = Counter("rlfabric_reward_timeouts_total", "Verifications that ran past their deadline", ["verifier"])
ERRORS = Counter(
    "rlfabric_reward_errors_total", "Verifications that failed (exception, crash, non-finite, remote)",
    ["verifier", "reason"],
)
QUEUE_DEPTH = Gauge("rlfabric_reward_queue_depth", "Verifications waiting for a pool process")
IN_FLIGHT_SAMPLES = Gauge("rlfabric_reward_samples_in_flight", "Samples received and not yet answered")
PROCESS_RESTARTS = Counter(
    "rlfabric_reward_pool_process_restarts_total", "Pool processes replaced after a timeout or crash"
)
REMOTE_CIRCUIT_OPEN = Gauge(
    "rlfabric_reward_remote_circuit_open", "1 while a remote verifier's circuit breaker is open", ["verifier"]
)


def record_outcome(verifier: str, latency_s: float, reason: str) -> None:
    """Counts one finished verification; `reason` is "" on success, else the failure kind."""
    SCORES.labels(verifier).inc()
    LATENCY.labels(verifier).observe(latency_s)
    if reason == "timeout":
        TIMEOUTS.labels(verifier).inc()
    elif reason:
        ERRORS.labels(verifier, reason).inc()
