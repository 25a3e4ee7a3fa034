"""Charts of a run from its metrics JSONL: reward and accuracy, response length, KL / entropy / grad norm, and
the per-iteration timeline of the phases (how rollout, reward, reference pass, update and weight sync overlap).

The timeline uses the coordinator's `timeline/{phase}/start|end` metrics (seconds since the iteration's
start) when the run logged them. Older runs only have the seed's `timing/*` spans; their timeline is then
reconstructed from the parity rules the coordinator computes them with (see iteration_metrics.py): the
rollout starts the iteration; reward and reference passes end `timing/non_overlap_*` after it (or after the
old-log-prob pass), and last `timing/*`; old log-probs, advantages, the update and the weight sync follow
one another. The chart says which of the two it shows. Rendering is matplotlib's Agg (no display needed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Metrics = Sequence[Mapping[str, float]]

# Colours of the phases a timeline shows; a phase not named here (a new one) gets one of OTHER_COLORS.
PHASE_COLORS = {"rollout": "#4C72B0", "rule_reward": "#DD8452", "reward_model": "#DA8BC3",
                "reference_model": "#55A868", "old_log_p": "#8172B3", "adv": "#937860", "update": "#C44E52",
                "resharding_to_infer": "#64B5CD", "resharding_enter_infer": "#64B5CD",
                "resharding_exit_infer": "#9BD0E0", "resharding_to_train": "#8C8C8C",
                "resharding_enter_train": "#8C8C8C", "resharding_exit_train": "#B5B5B5", "ref_onload": "#A6D8A8",
                "ref_offload": "#A6D8A8"}
OTHER_COLORS = ("#CCB974", "#8EBA42", "#E24A33", "#348ABD")


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
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
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


def plot_run(metrics: Metrics, out_dir: Path, title: str = "") -> list[Path]:
    """Writes the four PNGs to `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from services.report import figures

    out_dir.mkdir(parents=True, exist_ok=True)
    return [figures.reward(metrics, out_dir / "reward.png", title),
            figures.response_length(metrics, out_dir / "response_length.png", title),
            figures.training(metrics, out_dir / "kl_entropy_grad_norm.png", title),
            figures.timeline(metrics, out_dir / "timeline.png", title)]


def load(path: str | Path) -> tuple[Path, list[dict[str, Any]]]:
    found = find_metrics(path)
    return found, read_metrics(found)
