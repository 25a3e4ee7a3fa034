"""Reward goes up on a mixture-of-experts model: GRPO through the real CLI (`rlfabric up`: Redis, a reward worker,
the demo's custom verifier, a vLLM replica serving the MoE model, Megatron actor and reference trainers at EP2,
the coordinator) on the demo's task ("A+B=", A, B in 0..99), from a supervised warm-up, routing replay on.

The model: a tiny Qwen3-MoE (hidden 128, 2 layers, each 8 routed experts of 64, top-2) with the demo's digit-split
tokenizer of 512 entries. The warm-up is the dense demo's, unchanged (`rlfabric sft --recipe addition`, in
process): on this model it stops at step 1,300 (training-slice accuracy 0.458) with held-out greedy accuracy
0.404, in ~260 s on 2 shared cores (HF's MoE block loops over experts). GRPO then runs 100 iterations of
`configs/grpo_demo_moe_cpu.yaml` (actor and reference at EP2, `rlfabric.routing_replay: rollout`), ~190-280 s
with start-up at load average 5-10.

Margin, measured (2-core machine, shared with other runs): 8 runs of exactly this shape (100 iterations from the
same warm-up, sampling seed 1..8, validation before and after) gave, for the mean training reward of the last 10
iterations minus that of the first 10: 0.094, 0.100, 0.106, 0.112, 0.116, 0.119, 0.139, 0.167 (mean 0.119,
standard deviation 0.024; first-10 means 0.31-0.35, last-10 means 0.43-0.48); greedy held-out accuracy went from
0.404 to 0.60-0.65 (gain 0.198-0.242, mean 0.225). MARGIN = 0.04 (the dense test's) is 3.3 standard deviations
below the mean and below every measured run; VAL_MARGIN = 0.10 is half the smallest measured accuracy gain; with
learning broken both centre on 0 and the test fails.
The sampling seed is fixed, so a given machine repeats its verdict.

Routing replay: with one optimizer step per iteration (mini_batch_size = global_batch_size) the trainer holds the
replica's weights in every pass, so its own routers choose exactly the replayed experts (changed fraction 0.0 in
every measured iteration); a sample given another sample's routing would change most choices. So the check here is
that every sample's experts reach the trainer aligned; bench/RESULTS.md measures what replay removes.
Slow (`make soak`): warm-up and run take 8-10 minutes on 2 shared cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.report.run_metrics import find_metrics, read_metrics
from services.report.seed_metrics import check_record
from tests.e2e.addition_work import write_addition_work

CONFIG = "configs/grpo_demo_moe_cpu.yaml"
VERIFIER = "leading_number"
ITERATIONS = 100
MARGIN = 0.04
VAL_MARGIN = 0.10


@pytest.fixture(scope="module")
def moe_addition_warmup(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """The demo's work folder (tests/e2e/addition_work.py) for a tiny Qwen3-MoE."""
    return write_addition_work(tmp_path_factory.mktemp("moe_addition"), repo_root, family="qwen3_moe")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the warm-up (a fixture, counted here) and the run: ~10 minutes at load average 8
def test_reward_goes_up_on_a_moe_model_at_ep2(moe_addition_warmup: Path, repo_root: Path, tmp_path: Path) -> None:
    work = moe_addition_warmup
    sft = json.loads((work / "sft_model" / "sft_summary.json").read_text())
    assert 0.3 <= sft["held_out_greedy_accuracy"] <= 0.7, sft  # the warm-up lands where GRPO has room to learn
    verifier = f"{VERIFIER}={sys.executable} examples/grpo/leading_number_verifier.py --port {{port}}"
    proc = subprocess.run([
        sys.executable, "-m", "services.cli", "up", CONFIG,
        "-o", f"megatron_training.tokenizer_name_or_path={work / 'sft_model'}",
        "-o", f"megatron_training.data_path={work / 'dataset' / 'train'}",
        "-o", f"rlfabric.val_data_path={work / 'dataset' / 'heldout'}",
        "-o", f"actor_config.load={work / 'sft_model'}", "-o", f"actor_config.save={tmp_path / 'ckpt'}",
        "-o", f"megatron_training.train_iters={ITERATIONS}", "-o", f"rlfabric.val_interval={ITERATIONS}",
        "-o", "generate_config.sampling_config.seed=1",
        "--run-dir", str(tmp_path), "--verifier-command", verifier],
        cwd=repo_root, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(find_metrics(tmp_path))
    train = [r for r in records if r["iteration"] >= 1]
    assert [int(r["iteration"]) for r in train] == list(range(1, ITERATIONS + 1))
    rewards = [r["grpo/score/mean"] for r in train]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    assert last - first >= MARGIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
    # Validation before training measures the warm-up model greedily through the MoE replica, exactly as the
    # warm-up's teacher-forced check does in transformers (vLLM's fused-MoE greedy == HF argmax); after the last
    # iteration it measures what GRPO learnt, on problems it never trained on.
    before = records[0]
    assert before["iteration"] == 0
    assert before["val/pass@1"] == pytest.approx(sft["held_out_greedy_accuracy"], abs=0.01)
    assert train[-1]["val/pass@1"] - before["val/pass@1"] >= VAL_MARGIN, (before["val/pass@1"], train[-1])
    for r in train:
        assert check_record(r, [VERIFIER]) == [], r["iteration"]
        assert r["moe/aux_loss"] > 0 and r["moe/expert_load_max_over_mean"] >= 1.0, r
        assert 0 <= r["moe/routing_replay_changed_fraction"] < 0.01, r  # see the module docstring
        assert r["world_size"] == 6  # the devices of the config: actor 2 and reference 2 (EP2 each), rollout 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
