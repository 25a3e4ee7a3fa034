"""The whole system through its real CLI: `rlfabric up` starts Redis, a reward worker, a vLLM rollout replica,
actor and reference Megatron trainers and the coordinator, all as separate processes talking gRPC, and
runs GRPO iterations on the tiny model. This is the smoke test every service joins.

The two-iteration run is in integrated (all-shared-device) mode with every `offload_train_*` key on, as the
seed's own 7B config, and with two optimizer steps per iteration (so old log-probs are computed): it checks the
mode's timings and that the services' memory really falls while they sleep. The resume test runs disaggregated.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SEED_METRICS = [
    "timing/all", "timing/update", "timing/rollout", "timing/old_log_p", "timing/reference_model",
    "timing/resharding_to_train", "timing/resharding_to_infer", "timing/adv", "timing/non_overlap_reference_model",
    "timing/non_overlap_rule_reward", "timing/non_overlap_reward_model", "timing/non_overlap_adv",
    "timing/rule_reward", "timing/reward_model", "timing/ref_onload", "timing/ref_offload",
    "actor/entropy", "actor/kl_loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "grad_norm",
    "math_17k_acc_rewards/mean", "actor/lr",
    "grpo/score/mean", "grpo/score/max", "grpo/score/min", "grpo/rewards/mean", "grpo/rewards/max", "grpo/rewards/min",
    "response_length/mean", "response_length/min", "response_length/max",
    "prompt_length/mean", "prompt_length/max", "prompt_length/min",
    "global_batch_size", "n_samples_per_prompt", "world_size", "e2e_tps", "update_tps", "vllm_tps",
]


def run_up(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={tiny_model_dir}",
            "-o", f"megatron_training.data_path={arith_prefix}",
            "-o", f"actor_config.load={tiny_model_dir}",
            "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "--run-dir", str(run_dir), *extra]
    return subprocess.run(args, cwd=repo_root, capture_output=True, text=True, timeout=900)


def read_metrics(run_dir: Path) -> list[dict]:
    files = list((run_dir / "runs").glob("*/metrics.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


@pytest.fixture(scope="module")
def two_iterations(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("up")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir,
                  "-o", "megatron_training.train_iters=2", "-o", "megatron_training.save_interval=2",
                  "-o", "rl_config.use_integrated_worker=true", "-o", "rl_config.mini_batch_size=4",
                  "-o", "generate_config.offload_train_param=true", "-o", "generate_config.offload_train_grad=true",
                  "-o", "generate_config.offload_train_optimizer=true")
    return proc, run_dir


def test_run_finishes_and_logs_every_seed_metric(two_iterations: tuple) -> None:
    proc, run_dir = two_iterations
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        missing = [k for k in SEED_METRICS if k not in m]
        assert not missing, missing
        assert all(math.isfinite(m[k]) for k in SEED_METRICS)
        assert (m["global_batch_size"], m["n_samples_per_prompt"], m["world_size"]) == (8, 8, 1)
        assert 0 < m["response_length/min"] <= m["response_length/mean"] <= m["response_length/max"] <= 64
        assert m["timing/all"] >= m["timing/rollout"] + m["timing/update"] > 0
        assert m["timing/reference_model"] > 0 and m["timing/rule_reward"] > 0
        assert m["e2e_tps"] > 0 and m["vllm_tps"] >= m["e2e_tps"]
        assert m["actor/lr"] == pytest.approx(1e-5)
    # Every update makes the next weights version (after the sync that precedes iteration 1); integrated mode
    # pushes it when the next iteration wakes the rollout.
    versions = [m["weights_version"] for m in metrics]
    assert versions[0] >= 2 and versions[1] == versions[0] + 1
    assert "iteration 2/2" in proc.stdout and "RUN_PHASE_DONE" in proc.stdout


# Timings the seed lists that must have run in this configuration (integrated, with a reference, old log-probs
# computed); no reward model, so its two are 0; the non-overlap ones may legitimately be 0.
RUN_TIMINGS = ["timing/all", "timing/update", "timing/rollout", "timing/old_log_p", "timing/reference_model",
               "timing/resharding_to_train", "timing/resharding_to_infer", "timing/adv", "timing/rule_reward",
               "timing/ref_onload", "timing/ref_offload"]
MIB = 1 << 20


def test_integrated_mode_measures_every_timing_of_the_seed(two_iterations: tuple) -> None:
    proc, run_dir = two_iterations
    assert proc.returncode == 0
    for m in read_metrics(run_dir):
        assert all(m[k] > 0 for k in RUN_TIMINGS), {k: m[k] for k in RUN_TIMINGS}
        assert m["timing/reward_model"] == 0 and m["timing/non_overlap_reward_model"] == 0
        # The seed: in the all-shared-device mode these phases run one after another.
        serial = sum(m[f"timing/{k}"] for k in ("rollout", "old_log_p", "update", "reference_model",
                                                "resharding_to_train", "resharding_to_infer"))
        assert m["timing/all"] >= serial + max(m["timing/non_overlap_rule_reward"],
                                               m["timing/non_overlap_reference_model"])
        # Upstream's order: wake/sync/offload, generate, sleep, the reference between its onload and offload,
        # the actor's old log-probs, its onload, the update, its offload.
        order = ["resharding_enter_infer", "rollout", "resharding_exit_infer", "ref_onload", "reference_model",
                 "ref_offload", "old_log_p", "resharding_enter_train", "update", "resharding_exit_train"]
        spans = [(m[f"timeline/{p}/start"], m[f"timeline/{p}/end"]) for p in order]
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), dict(zip(order, spans,
                                                                                          strict=True))


def test_integrated_mode_frees_memory_while_a_service_sleeps(two_iterations: tuple) -> None:
    """Resident set sizes the services report: the rollout drops its 1 GiB CPU KV cache while asleep, the actor
    writes out its weights, gradients and Adam moments (16 MiB for the tiny model) while the rollout runs.
    Margins from several runs: the rollout fell by 0.97-0.98 GiB each time; the actor by 20-170 MiB (the heap
    its passes freed goes back with the state)."""
    proc, run_dir = two_iterations
    assert proc.returncode == 0
    for m in read_metrics(run_dir):
        assert m["memory/rollout/resident_bytes_awake"] - m["memory/rollout/resident_bytes_asleep"] > 512 * MIB
        assert m["memory/actor/resident_bytes_onloaded"] - m["memory/actor/resident_bytes_offloaded"] > 8 * MIB


def test_run_writes_a_megatron_checkpoint(two_iterations: tuple) -> None:
    proc, run_dir = two_iterations
    assert proc.returncode == 0
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_no_service_outlives_the_run(two_iterations: tuple) -> None:
    _proc, run_dir = two_iterations
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert out.stdout.strip() == ""


@pytest.mark.slow  # CI: tests/reliability/test_crash_resume_short.py covers resuming
def test_killed_run_resumes_from_its_checkpoint_with_the_same_data(repo_root: Path, tiny_model_dir: Path,
                                                                    arith_prefix: Path, tmp_path: Path) -> None:
    """Two iterations, a stop, then `--resume` to three: the third iteration continues the data cursor and
    the checkpoint, and the journal holds every iteration once."""
    run_dir = tmp_path / "run"
    first = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir, "--run-id", "resume-me",
                   "-o", "megatron_training.train_iters=2", "-o", "megatron_training.save_interval=1")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ckpt = run_dir / "ckpt"
    resumed = run_up(
        repo_root, tiny_model_dir, arith_prefix, run_dir, "--run-id", "resume-me", "--resume",
        "-o", "megatron_training.train_iters=3", "-o", "megatron_training.save_interval=1",
        "-o", "actor_config.finetune=false", "-o", f"actor_config.load={ckpt}",
        "-o", "actor_config.no_load_optim=false", "-o", "actor_config.no_load_rng=false",
        # Disaggregated mode: the reference has its own section and keeps loading the ORIGINAL weights.
        "-o", f"ref_config.load={tiny_model_dir}", "-o", "ref_config.finetune=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2, 3]  # one JSONL per run id, appended by the resumed run
    assert "iteration 3/3" in resumed.stdout and "iteration 1/3" not in resumed.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert [m["data/batch_index"] for m in metrics] == [0, 1, 2]  # the cursor continued, no batch seen twice
    assert all(m["world_size"] == 3 for m in metrics)  # disaggregated: actor, reference and rollout, one device each
    # The resumed run synced the replica to a version above every version served before.
    assert metrics[2]["weights_version"] > metrics[1]["weights_version"] + 1
