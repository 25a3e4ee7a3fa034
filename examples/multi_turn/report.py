"""The last step of the multi-turn demo: what GRPO did with the tool, in a few lines, and whether it met its marks.

Reads the demo's work folder: the warm-up's `sft_model/warmup_summary.json` and the run's metrics JSONL. Prints
the warm-up, then the first WINDOW -> the last WINDOW iterations' means of the training reward (retool_reward), the tool
calls per sample, the tool success rate (calls that ran, of the calls made: a malformed call or a sandbox failure
is an error) and the response lengths (the model's tokens and the tool's, which are context, not trained on).
Checks that reward, calls per sample and success rate rose by the marks of `MARKS`, which
tests/e2e/test_multi_turn_up.py asserts too. Exits 1 when a check fails.

    python examples/multi_turn/report.py WORK_DIR [--seconds N]
"""

import argparse
import json
import sys
from pathlib import Path

from services.report.run_metrics import find_metrics, read_metrics

# GRPO moves the warmed-up policy within a few iterations (measured, 40 iterations of 8 x 8: the calls per sample
# from 0.55 at iteration 1 to 0.97 at iteration 3), so a wider first window would average the rise away.
WINDOW = 5
# Rise of the mean of the last WINDOW iterations over the first WINDOW, per metric, about half of what was measured
# (the demo, 40 iterations: reward -0.150 -> 0.649, calls per sample 0.847 -> 0.997, success rate 0.791 -> 0.962).
MARKS = {"grpo/score/mean": 0.3, "tool/calls_per_sample": 0.05, "tool/success_rate": 0.05}
SHOWN = {"grpo/score/mean": "training reward (retool_reward)", "tool/calls_per_sample": "tool calls per sample",
         "tool/success_rate": "tool success rate", "response_length/generated_mean": "model tokens per response",
         "response_length/tool_mean": "tool tokens per response (masked out of the loss)"}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="the demo's work folder")
    parser.add_argument("--seconds", type=float, default=None, help="the demo's wall time so far")
    args = parser.parse_args(argv)
    warmup = json.loads((args.work / "sft_model" / "warmup_summary.json").read_text())
    metrics_path = find_metrics(args.work / "run")
    train = [r for r in read_metrics(metrics_path) if r["iteration"] >= 1]
    if len(train) < 2 * WINDOW:
        print(f"{metrics_path}: {len(train)} iterations; the report compares the first and last {WINDOW}")
        return 1
    s = warmup["settings"]
    print(f"warm-up: {warmup['steps_run']} steps x {s['batch_size']} conversations ({warmup['direct_rows']} of "
          f"{warmup['train_rows']} problems taught as a direct answer), {warmup['seconds']:.0f} s; held out, greedy "
          f"decoding solves {warmup['held_out_tool_path_accuracy']:.0%} through the tool")
    seconds = sorted(r["timing/all"] for r in train)
    print(f"GRPO (rlfabric up): {len(train)} iterations x {train[0]['global_batch_size']:.0f} prompts x "
          f"{train[0]['n_samples_per_prompt']:.0f} samples; median {seconds[len(seconds) // 2]:.1f} s per iteration")
    rises = {}
    for key, label in SHOWN.items():
        first, last = mean([r[key] for r in train[:WINDOW]]), mean([r[key] for r in train[-WINDOW:]])
        rises[key] = last - first
        print(f"  {label}: {first:.3f} -> {last:.3f} ({last - first:+.3f}; mean of the first {WINDOW} -> "
              f"the last {WINDOW} iterations)")
    print(f"metrics: {metrics_path}; charts: {metrics_path.parent / 'plots'}")
    checks = [(f"{SHOWN[key]} rose by more than {mark}", rises[key] > mark) for key, mark in MARKS.items()]
    for text, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {text}")
    if args.seconds is not None:
        print(f"demo wall time: {args.seconds // 60:.0f} min {args.seconds % 60:.0f} s")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
