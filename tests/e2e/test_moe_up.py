"""GRPO on the tiny Qwen3-MoE through `rlfabric up` (configs/grpo_tiny_moe_cpu.yaml): actor and reference at EP2
(two ranks each, four experts per rank), a vLLM replica serving the MoE model, the weights pushed after every
update. Checked: the run ends DONE, every iteration logs the MoE metrics and the rollout/trainer log-prob
mismatch, and the replica serves exactly the trainer's weights (the mismatch stays at fp32 noise: a misplaced
expert would make it large). In CI with routing replay on (`rlfabric.routing_replay: rollout`: the replica
returns each sample's experts, the trainer's three passes use them); without it in the soak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ITERS = 3


@pytest.mark.parametrize("replay", ["rollout", pytest.param("none", marks=pytest.mark.slow)])
def test_grpo_on_a_moe_model_at_ep2_through_up(repo_root: Path, tiny_moe_dir: Path, arith_prefix: Path,
                                               tmp_path: Path, replay: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([
        sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_moe_cpu.yaml",
        "-o", f"megatron_training.tokenizer_name_or_path={tiny_moe_dir}",
        "-o", f"megatron_training.data_path={arith_prefix}", "-o", f"actor_config.load={tiny_moe_dir}",
        "-o", f"actor_config.save={run_dir / 'ckpt'}", "-o", f"megatron_training.train_iters={ITERS}",
        "-o", "megatron_training.save_interval=100", "-o", "generate_config.sampling_config.max_tokens=16",
        # two optimizer steps per iteration: the old-log-prob pass runs, so rollout_mismatch/* is logged
        "-o", "rl_config.mini_batch_size=4", "-o", f"rlfabric.routing_replay={replay}",
        "--run-id", "moe", "--run-dir", str(run_dir)],
        cwd=repo_root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run moe: RUN_PHASE_DONE at iteration {ITERS}" in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(x) for x in (run_dir / "runs" / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    for r in rows:
        assert r["moe/aux_loss"] > 0 and r["moe/expert_load_max_over_mean"] >= 1.0, r
        # Weights version k+1 on the replica equals the trainer's after update k: rollout log-probs of the
        # sampled tokens equal the trainer's to fp32 noise (a wrong expert shard would be off by far more).
        assert 0 <= r["rollout_mismatch/mean_abs_logp_diff"] < 1e-3, r["rollout_mismatch/mean_abs_logp_diff"]
        if replay == "rollout":
            # fp32 on both sides: the trainer's routers agree with the replica's choices, but for the tokens of
            # the second mini-batch whose choice the first step moved (~1 %); misaligned rows would differ on most.
            assert 0 <= r["moe/routing_replay_changed_fraction"] < 0.1, r
        else:
            assert "moe/routing_replay_changed_fraction" not in r
    assert [r["weights_version"] for r in rows] == list(range(2, ITERS + 2))  # version 1: the start's sync
    saved = (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert saved == str(ITERS)
    iteration_dir = run_dir / "ckpt" / f"iter_{ITERS:07d}"
    assert sorted(p.name for p in iteration_dir.iterdir() if p.name.startswith("mp_rank")) == \
        ["mp_rank_00_000", "mp_rank_00_001"]  # one folder per expert-parallel rank, as Megatron names them
