"""`rlfabric plot RUN_DIR`: PNG charts of a run from its metrics JSONL (services/report/figures.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plot", help="charts of a run: reward and accuracy, response length, KL/entropy/grad norm, phase timeline",
        description="Reads RUN_DIR/runs/RUN_ID/metrics.jsonl (the newest run), RUN_DIR/metrics.jsonl or a "
                    "metrics.jsonl file and writes reward.png, response_length.png, kl_entropy_grad_norm.png and "
                    "timeline.png. Works on a run in progress too.")
    p.add_argument("run", type=Path, help="the --run-dir of `rlfabric up`, a runs/RUN_ID folder or a metrics.jsonl")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: plots/ beside the metrics file)")
    p.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    from services.report.figures import plot_run
    from services.report.run_metrics import load

    try:
        path, metrics = load(args.run)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or path.parent / "plots"
    iterations = sum(1 for m in metrics if m["iteration"] >= 1)  # iteration 0: validation before training
    for png in plot_run(metrics, out, title=f"{path.parent.name} ({iterations} iterations)"):
        print(png)
    return 0
