"""Reward goes up: GRPO through the real CLI (`rlfabric up`: Redis, a reward worker, the custom verifier of
`make demo`, a vLLM rollout replica, Megatron actor and reference trainers, the coordinator) on the learnable
task of the demo ("A+B=", A, B in 0..99), from the demo's supervised warm-up, with a fixed sampling seed.

The warm-up (`rlfabric sft --recipe addition`, in process: ~1,300 steps, ~80 s on 2 cores) is a session
fixture; the short test then runs 100 iterations of `configs/grpo_demo_cpu.yaml` (~60 s with start-up).

Margin, measured (2-core machine, shared): 10 runs of exactly this shape (100 iterations of the demo config from
the same warm-up, sampling seed drawn per run, no validation) gave, for the mean training reward of the last 10
iterations minus that of the first 10: 0.066, 0.073, 0.080, 0.105, 0.106, 0.116, 0.120, 0.130, 0.131, 0.172
(mean 0.110, standard deviation 0.032; first-10 means 0.29-0.37, last-10 means 0.40-0.47). MARGIN = 0.04 is
2.2 standard deviations below the mean and below every measured run; with learning broken the gain centres on 0
and the test fails. The sampling seed is fixed, so a given machine repeats its verdict.
The slow test (`make soak`) runs the demo's full length and asserts the demo's marks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.report.run_metrics import find_metrics, read_metrics
from services.report.seed_metrics import check_record

CONFIG = "configs/grpo_demo_cpu.yaml"
VERIFIER = "leading_number"
SHORT_ITERATIONS = 100
MARGIN = 0.04


@pytest.fixture(scope="session")
def addition_warmup(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """A work folder like the demo's: base_model, task/{train,heldout}.jsonl, dataset/{train,heldout}, sft_model."""
    import torch

    from services.common.tiny_model import write_tiny_model
    from services.data.dataset_config import load_dataset_config
    from services.data.preprocess import preprocess
    from services.data.synthetic import write_addition_task
    from services.sft.train import RECIPES, train

    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("addition")
    base = write_tiny_model(work / "base_model", vocab_size=512, split_digits=True)
    train_rows, held_out = write_addition_task(work / "task", held_out=500)
    for split, path in (("train", train_rows), ("heldout", held_out)):
        preprocess(load_dataset_config(repo_root / "configs" / "datasets" / "deepscaler.yaml", [
            f"input={path}", f"tokenizer_name_or_path={base}", f"output_prefix={work / 'dataset' / split}",
            "prompt_type=empty", "workers=1"]))

    def rows(path: Path) -> list[tuple[str, str]]:
        return [(r["problem"], r["answer"]) for r in map(json.loads, path.read_text().splitlines())]

    train(base, rows(train_rows), work / "sft_model", RECIPES["addition"], held_out_rows=rows(held_out))
    return work


def run_grpo(repo_root: Path, work: Path, run_dir: Path, iterations: int, *extra: str) -> subprocess.CompletedProcess:
    verifier = f"{VERIFIER}={sys.executable} examples/grpo/leading_number_verifier.py --port {{port}}"
    args = [sys.executable, "-m", "services.cli", "up", CONFIG,
            "-o", f"megatron_training.tokenizer_name_or_path={work / 'sft_model'}",
            "-o", f"megatron_training.data_path={work / 'dataset' / 'train'}",
            "-o", f"rlfabric.val_data_path={work / 'dataset' / 'heldout'}",
            "-o", f"actor_config.load={work / 'sft_model'}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "-o", f"megatron_training.train_iters={iterations}",
            "--run-dir", str(run_dir), "--verifier-command", verifier, *extra]
    return subprocess.run(args, cwd=repo_root, capture_output=True, text=True, timeout=1800)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_reward_goes_up(addition_warmup: Path, repo_root: Path, tmp_path: Path) -> None:
    sft = json.loads((addition_warmup / "sft_model" / "sft_summary.json").read_text())
    assert 0.4 <= sft["held_out_greedy_accuracy"] <= 0.7, sft  # the warm-up lands where GRPO has room to learn
    proc = run_grpo(repo_root, addition_warmup, tmp_path, SHORT_ITERATIONS,
                    "-o", "generate_config.sampling_config.seed=1", "-o", f"rlfabric.val_interval={SHORT_ITERATIONS}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(find_metrics(tmp_path))
    train = [r for r in records if r["iteration"] >= 1]
    assert [int(r["iteration"]) for r in train] == list(range(1, SHORT_ITERATIONS + 1))
    rewards = [r["grpo/score/mean"] for r in train]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    assert last - first >= MARGIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
    # Validation: before training (iteration 0) it measures the warm-up model, greedily, exactly as the
    # warm-up's own teacher-forced check does (vLLM greedy == argmax), and after the last iteration again.
    before = records[0]
    assert before["iteration"] == 0
    assert before["val/pass@1"] == pytest.approx(sft["held_out_greedy_accuracy"], abs=0.01)
    assert "val/pass@1" in train[-1] and all("val/pass@1" not in r for r in train[:-1])
    for r in train:
        assert check_record(r, [VERIFIER]) == [], r["iteration"]
    # The console: start-up progress, the verifier registered, one short line per iteration.
    out = proc.stdout
    assert "rollout-0 (vLLM) ready" in out and f"verifier {VERIFIER} registered" in out
    last_line = next(line for line in out.splitlines() if line.startswith(f"iteration {SHORT_ITERATIONS}/"))
    assert " | reward " in last_line and " | val " in last_line and " | tok/s " in last_line
    assert len(last_line) < 120


@pytest.mark.slow
def test_demo_length_run_learns(addition_warmup: Path, repo_root: Path, tmp_path: Path) -> None:
    """The demo's marks at the demo's length (its config as written): reward +0.15 (last 5 vs first 5
    iterations), greedy held-out accuracy up, the final model sampled independently within 0.05 of the
    training reward of the last 50 iterations (see examples/grpo/demo_report.py for why 50)."""
    proc = run_grpo(repo_root, addition_warmup, tmp_path, 500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(find_metrics(tmp_path))
    rewards = [r["grpo/score/mean"] for r in records if r["iteration"] >= 1]
    assert mean(rewards[-5:]) - mean(rewards[:5]) >= 0.15
    val = [r["val/pass@1"] for r in records if "val/pass@1" in r]
    assert len(val) == 6 and val[-1] > val[0]
    final = tmp_path / "final_model"
    subprocess.run([sys.executable, "-m", "services.cli", "convert", "mcore2hf", str(tmp_path / "ckpt"), str(final),
                    "--quiet"], cwd=repo_root, check=True, timeout=600)
    verifier = f"{VERIFIER}={sys.executable} examples/grpo/leading_number_verifier.py --port {{port}}"
    out = tmp_path / "eval"
    subprocess.run([sys.executable, "-m", "services.cli", "eval", "--model", str(final), "--dataset",
                    str(addition_warmup / "task" / "heldout.jsonl"), "--template", "empty", "--max-tokens", "8",
                    "-n", "8", "--temperature", "1", "--verifier-function", VERIFIER, "--verifier-command", verifier,
                    "--out", str(out)], cwd=repo_root, check=True, timeout=900, capture_output=True)
    sampled = json.loads((out / "results.json").read_text())["results"]["heldout"]["pass@1"]
    assert abs(sampled - mean(rewards[-50:])) <= 0.05
