"""A run's metrics JSONL, read, and the series the charts of `rlfabric plot` draw from it (no matplotlib here).

The timeline uses the coordinator's `timeline/{phase}/start|end` metrics (seconds since the iteration's
start) when the run logged them. Older runs only have the seed's `timing/*` spans; their timeline is then
reconstructed from the parity rules the coordinator computes them with (see iteration_metrics.py): the
rollout starts the iteration; reward and reference passes end `timing/non_overlap_*` after it (or after the
old-log-prob pass), and last `timing/*`; old log-probs, advantages, the update and the weight sync follow
one another. `phase_spans` says which of the two it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.common.jsonl import json_lines

Metrics = Sequence[Mapping[str, float]]


def find_metrics(path: str | Path) -> Path:
    """The metrics JSONL of a run: the file itself, RUN_DIR/metrics.jsonl, or the newest runs/*/metrics.jsonl."""
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (p / "metrics.jsonl", *sorted((p / "runs").glob("*/metrics.jsonl"),
                                                   key=lambda f: f.stat().st_mtime, reverse=True)):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no metrics.jsonl in {p} (nor in {p / 'runs'}/*/): pass a run directory of "
                            "`rlfabric up` or a metrics.jsonl file")


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The iterations of a metrics JSONL, in order; the last record of an iteration wins (a resumed run)."""
    by_iteration: dict[int, dict[str, float]] = {}
    for _, record in json_lines(path):
        by_iteration[int(record["iteration"])] = record
    if not by_iteration:
        raise ValueError(f"{path}: no iteration logged yet")
    return [by_iteration[k] for k in sorted(by_iteration)]


def series(metrics: Metrics, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(iterations, values) of the iterations that logged `key`."""
    rows = [(m["iteration"], m[key]) for m in metrics if key in m]
    if not rows:
        return np.zeros(0), np.zeros(0)
    it, values = zip(*rows, strict=True)
    return np.asarray(it, dtype=float), np.asarray(values, dtype=float)


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    if len(values) == 0:
        return values
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (cumulative[idx] - cumulative[lo]) / (idx - lo)


def phase_spans(m: Mapping[str, float]) -> tuple[dict[str, tuple[float, float]], bool]:
    """{phase: (start, end)} within one iteration, in order of start, and whether they are logged (True) or
    reconstructed from timing/* (False)."""
    logged = {k[len("timeline/"):-len("/start")]: (v, m.get(k[:-len("start")] + "end", v)) for k, v in m.items()
              if k.startswith("timeline/") and k.endswith("/start")}
    if logged:
        return dict(sorted(logged.items(), key=lambda kv: kv[1])), True
    t = {k.removeprefix("timing/"): v for k, v in m.items() if k.startswith("timing/")}
    spans: dict[str, tuple[float, float]] = {}
    rollout_end = t.get("rollout", 0.0)
    spans["rollout"] = (0.0, rollout_end)
    old_end = rollout_end
    if t.get("old_log_p", 0.0) > 0:
        spans["old_log_p"] = (rollout_end, rollout_end + t["old_log_p"])
        old_end = spans["old_log_p"][1]
    for phase in ("rule_reward", "reference_model"):
        if t.get(phase, 0.0) > 0:
            end = old_end + t.get(f"non_overlap_{phase}", 0.0)
            spans[phase] = (max(0.0, end - t[phase]), end)
    adv_end = old_end + t.get("non_overlap_adv", 0.0)
    spans["adv"] = (adv_end - t.get("adv", 0.0), adv_end)
    spans["update"] = (adv_end, adv_end + t.get("update", 0.0))
    spans["resharding_to_infer"] = (spans["update"][1], spans["update"][1] + t.get("resharding_to_infer", 0.0))
    return dict(sorted(spans.items(), key=lambda kv: kv[1])), False


def representative_iterations(metrics: Metrics, count: int = 3) -> list[Mapping[str, float]]:
    """`count` iterations spread over the run, skipping the first (its timing includes start-up work)."""
    pool = list(metrics[1:]) or list(metrics)
    picks = sorted({round(i) for i in np.linspace(0, len(pool) - 1, min(count, len(pool)))})
    return [pool[i] for i in picks]


def load(path: str | Path) -> tuple[Path, list[dict[str, Any]]]:
    """The metrics file `find_metrics` finds for `path`, and its iterations."""
    found = find_metrics(path)
    return found, read_metrics(found)
