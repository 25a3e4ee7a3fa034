"""Preprocessing throughput (rows/s) on the 7,474-row DeepScaleR MATH file, `workers` 1 vs 2.

Each run is a fresh `python -m services.data.cli configs/datasets/deepscaler.yaml` process (as a
user runs it), with the tiny model's tokenizer; runs alternate between the worker counts so machine noise
hits both alike. Two rates per run: overall (rows / whole wall time, imports and tokenizer loading included)
and after startup (rows / time from the first row read to the files renamed into place).

    .venv/bin/python bench/bench_preprocess.py [--repeats 3] [--tokenizer DIR] [--input FILE]

Prints a markdown table: median (min-max) per setting, and the 2-vs-1 ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_INPUT = REPO.parent / "shared" / "data" / "deepscaler" / "deepscaler_component_train_math.json"


def _machine() -> str:
    return machine_info("transformers", "tokenizers", "megatron-core")


def _run(input_path: Path, tokenizer: Path, workers: int, workdir: Path) -> dict:
    summary = workdir / f"summary_w{workers}.json"
    cmd = [sys.executable, "-m", "services.data.cli", "configs/datasets/deepscaler.yaml", "--quiet",
           "--set", f"input={input_path}", "--set", f"tokenizer_name_or_path={tokenizer}",
           "--set", f"output_prefix={workdir / f'w{workers}' / 'data'}", "--set", f"workers={workers}",
           "--summary-json", str(summary)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    wall = time.monotonic() - start
    out = json.loads(summary.read_text())
    out["wall_s"] = wall
    return out


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per worker count (default 3)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: a freshly written tiny model)")
    parser.add_argument("--input", default=str(DEFAULT_INPUT), help="input file (default: the 7,474-row MATH file)")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare (default 1,2)")
    args = parser.parse_args()
    worker_counts = [int(w) for w in args.workers.split(",")]

    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        workdir = Path(tmp)
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        if tokenizer is None:
            sys.path.insert(0, str(REPO))
            from services.common.tiny_model import write_tiny_model

            tokenizer = write_tiny_model(workdir / "tiny")
        machine = _machine()
        results: dict[int, list[dict]] = {w: [] for w in worker_counts}
        for _ in range(args.repeats):
            for w in worker_counts:  # alternate so drifting load hits every setting
                results[w].append(_run(Path(args.input), tokenizer, w, workdir))

    rows = results[worker_counts[0]][0]["rows_read"]
    print(f"## Preprocessing throughput: {Path(args.input).name} ({rows} rows), deepscaler.yaml settings "
          f"(R1AlpacaStyleInstructionHandler, qwen_r1), tiny byte-level BPE tokenizer\n")
    print(f"Machine: {machine}. {args.repeats} runs per setting, alternating; median (min-max).\n")
    print("| workers | rows/s overall | rows/s after startup | wall s |")
    print("|---|---|---|---|")
    for w in worker_counts:
        r = results[w]
        print(f"| {w} | {_fmt([x['rows_per_s'] for x in r])} | {_fmt([x['process_rows_per_s'] for x in r])} "
              f"| {statistics.median(x['wall_s'] for x in r):.1f} |")
    if len(worker_counts) == 2:
        a, b = (results[w] for w in worker_counts)
        ratio = (statistics.median(x["process_rows_per_s"] for x in b)
                 / statistics.median(x["process_rows_per_s"] for x in a))
        overall = statistics.median(x["rows_per_s"] for x in b) / statistics.median(x["rows_per_s"] for x in a)
        print(f"\nRatio workers {worker_counts[1]} / {worker_counts[0]}: {overall:.2f}x overall, "
              f"{ratio:.2f}x after startup.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
