"""Prometheus collectors of the trainer service (served on rank 0's `/metrics` by services.common.server).

Names follow prometheus.io: `rlfabric_trainer_` prefix, base units. The memory gauges repeat the last Update's
`memory/{role}/*` metrics (services/trainer/memory.py, docs/memory.md): the largest value over the group's ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Gauge

MEMORY_BYTES = Gauge("rlfabric_trainer_memory_bytes",
                     "Per-rank memory of the last update, largest over the group's ranks, by role and kind "
                     "(params, grads, optimizer, activations_peak, peak).", ["role", "kind"])


def observe_update(metrics: Mapping[str, float]) -> None:
    """Sets the memory gauges from an Update's metrics (`memory/{role}/{kind}_bytes`)."""
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "memory" and parts[2].endswith("_bytes"):
            MEMORY_BYTES.labels(role=parts[1], kind=parts[2].removesuffix("_bytes")).set(value)
