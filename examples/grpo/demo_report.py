"""The last step of `make demo`: what the run learned, in a few lines, and whether it met its marks.

Reads the demo's work folder: the warm-up's `sft_model/sft_summary.json`, the run's metrics JSONL (training
metrics per iteration; `val/*` from validation on the held-out set, iteration 0 being before training) and
`eval_final/results.json` (the final model sampled independently). Prints the before -> after figures and
checks:
- the mean training reward of the last 5 iterations exceeds that of the first 5 by at least 0.15;
- held-out greedy accuracy after GRPO is higher than before;
- the final model, sampled independently (temperature 1, fresh seeds), scores within 0.05 of the training
  reward of the last tenth of the run (50 of 500 iterations: 400 prompts, where the decaying learning rate
  is under a tenth of its peak; the data loader's order is fixed, so a shorter window rests on a few dozen
  always-the-same prompts whose difficulty shifts it by a few hundredths);
- every iteration's record holds the seed's metric table, its throughputs consistent with its lengths,
  sizes and times (services/report/seed_metrics.py).
Exits 1 when a check fails.

    python examples/grpo/demo_report.py WORK_DIR [--seconds N]
"""

import argparse
import json
import sys
from pathlib import Path

from services.report.run_metrics import find_metrics, read_metrics
from services.report.seed_metrics import check_record

MIN_REWARD_GAIN = 0.15
MAX_SAMPLED_GAP = 0.05
VERIFIER = "leading_number"


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="the demo's work folder")
    parser.add_argument("--seconds", type=float, default=None, help="the demo's wall time so far")
    args = parser.parse_args(argv)
    sft = json.loads((args.work / "sft_model" / "sft_summary.json").read_text())
    metrics_path = find_metrics(args.work / "run")
    records = read_metrics(metrics_path)
    train = [r for r in records if r["iteration"] >= 1]
    val = [(int(r["iteration"]), r["val/pass@1"]) for r in records if "val/pass@1" in r]
    final = json.loads((args.work / "eval_final" / "results.json").read_text())
    sampled = next(iter(final["results"].values()))

    s = sft["settings"]
    print(f"warm-up (rlfabric sft, transformers): {sft['steps_run']} steps x {s['batch_size']} rows, AdamW lr "
          f"{s['lr']:g} ({s['lr_decay_style']} after {s['lr_warmup_iters']} warm-up steps), stopped at train-check "
          f"accuracy {sft['train_check_accuracy']:.3f}; final loss {sft['final_loss']:.3f}; {sft['seconds']:.0f} s")
    rewards = [r["grpo/score/mean"] for r in train]
    seconds = [r["timing/all"] for r in train]
    print(f"GRPO (rlfabric up): {len(train)} iterations x {train[0]['global_batch_size']:.0f} prompts x "
          f"{train[0]['n_samples_per_prompt']:.0f} samples, lr {train[0]['actor/lr']:.2g} -> "
          f"{train[-1]['actor/lr']:.2g}; median {sorted(seconds)[len(seconds) // 2]:.2f} s and "
          f"{sorted(r['e2e_tps'] for r in train)[len(train) // 2]:.0f} tokens/s per iteration")
    before, after = val[0], val[-1]
    print(f"held-out greedy accuracy ({sampled['problems']:.0f} problems): {before[1]:.3f} (iteration {before[0]}) "
          f"-> {after[1]:.3f} (iteration {after[0]})")
    tail = max(10, len(rewards) // 10)
    first5, last5, last_tenth = mean(rewards[:5]), mean(rewards[-5:]), mean(rewards[-tail:])
    print(f"training reward, mean of the first 5 iterations -> the last 5: {first5:.3f} -> {last5:.3f} "
          f"({last5 - first5:+.3f})")
    n = final["settings"]["n"]
    print(f"final model sampled independently ({n} samples per held-out problem, temperature "
          f"{final['settings']['temperature']:g}, fresh seeds): {sampled['pass@1']:.3f} (pass@{n} "
          f"{sampled[f'pass@{n}']:.3f}); training reward of the last {tail} iterations: {last_tenth:.3f}")
    table_problems = [f"iteration {int(r['iteration'])}: {p}" for r in train for p in check_record(r, [VERIFIER])]
    print(f"metrics: {metrics_path} ({len(train)} iterations); charts: {metrics_path.parent / 'plots'}")
    checks = [
        (f"reward rose by at least {MIN_REWARD_GAIN} (last 5 vs first 5 iterations)", last5 - first5 >= MIN_REWARD_GAIN),
        ("held-out greedy accuracy after GRPO is higher than before", after[1] > before[1] and after[0] > before[0]),
        (f"the final model sampled independently is within {MAX_SAMPLED_GAP} of the last {tail} iterations' reward",
         abs(sampled["pass@1"] - last_tenth) <= MAX_SAMPLED_GAP),
        ("every iteration logs the seed's metric table, e2e/update/vllm tps consistent with lengths, sizes, times",
         not table_problems),
    ]
    for line in table_problems[:5]:
        print(f"  {line}")
    for text, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {text}")
    if args.seconds is not None:
        print(f"demo wall time: {args.seconds // 60:.0f} min {args.seconds % 60:.0f} s")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
