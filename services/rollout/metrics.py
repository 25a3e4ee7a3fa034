"""Prometheus collectors of the rollout service (served on `/metrics` by services.common.server).

Names follow prometheus.io: `rlfabric_rollout_` prefix, base units, `_total` for counters, no per-sample
labels. Tokens/s is `rate(rlfabric_rollout_generated_tokens_total[1m])`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

GENERATED_TOKENS = Counter("rlfabric_rollout_generated_tokens_total", "Response tokens generated.")
REQUESTS = Gauge("rlfabric_rollout_requests", "Samples inside the engine, by scheduler state.", ["state"])
REQUESTS_ADMITTED = Counter("rlfabric_rollout_requests_admitted_total", "Samples handed to the engine.")
SAMPLES_FINISHED = Counter("rlfabric_rollout_samples_finished_total", "Samples finished, by finish reason.",
                           ["reason"])
TIME_TO_FIRST_TOKEN = Histogram(
    "rlfabric_rollout_time_to_first_token_seconds",
    "Seconds from a sample's admission into the engine to its first generated token.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
WEIGHTS_VERSION = Gauge("rlfabric_rollout_weights_version", "Weights version served (0 = as loaded).")
WEIGHT_UPDATE_SECONDS = Histogram(
    "rlfabric_rollout_weight_update_seconds",
    "Seconds to apply a committed weight update inside the engine.",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_SYNC_SECONDS = Histogram(
    "rlfabric_rollout_weight_sync_seconds",
    "Seconds from the first bucket of an UpdateWeights stream to the end of the apply.",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
SLEEPING = Gauge("rlfabric_rollout_sleeping", "1 while the replica is asleep.")
SLEEP_SECONDS = Histogram("rlfabric_rollout_sleep_seconds", "Seconds a Sleep or Wake took.", ["op"])
STREAMS = Gauge("rlfabric_rollout_generate_streams", "Open Generate streams.")
