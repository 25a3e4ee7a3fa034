"""Where iteration metrics go: a console line, a JSONL file, TensorBoard (`train/{key}`), optionally wandb
and SwanLab.

The console line is short by default (iteration, reward, validation accuracy when there is one, response
length, KL, tokens/s, seconds), so a run reads at a glance; `full=True` prints every metric as MindSpeed-RL's
log does. The JSONL file is the machine-readable record of everything (one object per iteration, written
with a flush so a crash loses nothing already logged). It holds each iteration once: a resumed run appends
to the file of its run id, and when it recomputes iterations past its last checkpoint, their earlier rows
(and a row cut short by a crash) are dropped before the new ones go in.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger(__name__)

# The full console line shows these first, in this order; the rest follow sorted.
HEADLINE = ("timing/all", "grpo/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
            "grad_norm", "e2e_tps")
# The short line: (label, metric, format); a metric an iteration lacks is left out.
SHORT_LINE = (("reward", "grpo/score/mean", "{:.3f}"), ("val", "val/pass@1", "{:.3f}"),
              ("len", "response_length/mean", "{:.1f}"), ("kl", "actor/kl_loss", "{:.2e}"),
              ("tok/s", "e2e_tps", "{:.0f}"), ("s", "timing/all", "{:.2f}"))


def short_line(iteration: int, metrics: Mapping[str, float], total: int | None = None) -> str:
    """`iteration 3/10 | reward 0.453 | len 3.2 | kl 1.20e-03 | tok/s 2150 | s 0.32`."""
    of = f"/{total}" if total else ""
    parts = [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in SHORT_LINE if key in metrics]
    return " | ".join([f"iteration {iteration}{of}", *parts])


class MetricsSink:
    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ConsoleSink(MetricsSink):
    def __init__(self, stream: TextIO | None = None, total: int | None = None, full: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.total = total
        self.full = full

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        if not self.full:
            print(short_line(iteration, metrics, self.total), file=self.stream, flush=True)
            return
        keys = [k for k in HEADLINE if k in metrics] + sorted(k for k in metrics if k not in HEADLINE)
        of = f"/{self.total}" if self.total else ""
        body = " | ".join(f"{k}: {metrics[k]:.6g}" for k in keys)
        print(f"iteration {iteration}{of} | {body}", file=self.stream, flush=True)


class JsonlSink(MetricsSink):
    """One JSON object per iteration, appended; at most one row per iteration (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last = max((i for i, _ in _rows(self.path)), default=0)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        if iteration <= self._last:
            self._drop_from(iteration)
        self._last = iteration
        self._f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def _drop_from(self, iteration: int) -> None:
        """Rewrites the file without the rows of `iteration` and later ones (replaced atomically)."""
        self._f.close()
        kept = [line for i, line in _rows(self.path) if i < iteration]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        logger.info("%s: dropped the rows of iterations >= %d (recomputed by a resumed run)", self.path, iteration)
        self._f = self.path.open("a", encoding="utf-8")


def _rows(path: Path) -> list[tuple[int, str]]:
    """(iteration, line) of each complete row of an existing file; a line cut short by a crash is left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("iteration"), int | float):
            out.append((int(row["iteration"]), line))  # the run's metrics carry it as a float too
    return out


class TensorBoardSink(MetricsSink):
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(f"train/{k}", v, iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink(MetricsSink):
    def __init__(self, project: str, name: str, save_dir: str | None, config: dict[str, Any]) -> None:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError as e:
            raise RuntimeError("rl_config.use_wandb is true but the `wandb` package is not installed: "
                               "`pip install wandb`, or set use_wandb: false") from e
        self._run = wandb.init(project=project, name=name, dir=save_dir or None, config=config)

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self._run.log({f"train/{k}": v for k, v in metrics.items()}, step=iteration)

    def close(self) -> None:
        self._run.finish()


# The SwanLab release rlfabric is checked against, and how to install it: its metadata pins protobuf<7,
# which rlfabric's gRPC stubs cannot use, while it runs on protobuf 7 (offline mode is tested), hence --no-deps.
SWANLAB_INSTALL = ".venv/bin/pip install --no-deps -r requirements/swanlab.txt"


class SwanLabSink(MetricsSink):
    """MindSpeed-RL's SwanLabLogger: `swanlab.init(project, experiment_name, logdir, mode)`, then each
    iteration's metrics under their own names at step = iteration. A failed init (no network in `cloud`
    mode, say) costs the SwanLab record only, with a warning, as upstream."""

    def __init__(self, project: str, name: str, save_dir: str | Path, mode: str | None) -> None:
        if not project or not name:
            missing = "swanlab_project" if not project else "swanlab_exp_name"
            raise RuntimeError(f"rl_config.use_swanlab is true but {missing} is empty; set swanlab_project and "
                               "swanlab_exp_name")
        try:
            import swanlab  # type: ignore[import-not-found]
        except ImportError as e:
            raise RuntimeError("rl_config.use_swanlab is true but the `swanlab` package is not installed: "
                               f"`{SWANLAB_INSTALL}`, or set use_swanlab: false") from e
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self._run: Any = None
        try:
            self._run = swanlab.init(project=project, experiment_name=name, logdir=str(save_dir), mode=mode or None)
        except Exception as e:  # noqa: BLE001 (upstream logs and trains on without SwanLab)
            logger.warning("SwanLab did not start (%s): this run is not recorded in SwanLab", e)

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        if self._run is not None:
            self._run.log(dict(metrics), step=iteration)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class FanOut(MetricsSink):
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def write(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            try:
                sink.write(iteration, metrics)
            except Exception:  # a broken sink (full disk, wandb outage) must not stop training
                logger.exception("metrics sink %s failed at iteration %d", type(sink).__name__, iteration)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
