"""LoRA GRPO through the real CLI: `rlfabric up configs/grpo_tiny_cpu.yaml` with MindSpeed-RL's LoRA keys (every
target, lora_ckpt_filter), two iterations, with a separate reference (`make soak`) and with share_backbone (CI). The actor trains adapters only, the rollout
gets the merged weights after every update, and the checkpoint holds the adapters alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.trainer.lora import TARGET_KINDS, is_adapter_name
from tests.e2e.test_grpo_run import read_metrics, run_up

LORA = ["-o", "megatron_training.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        "-o", "megatron_training.lora_r=8", "-o", "megatron_training.lora_alpha=16",
        "-o", "megatron_training.lora_ckpt_filter=true", "-o", "megatron_training.lora_fusion=true"]


@pytest.fixture(scope="module")
def lora_run(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("lora_up")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir, *LORA,
                  "-o", "megatron_training.train_iters=2", "-o", "megatron_training.save_interval=2",
                  "-o", "rl_config.mini_batch_size=4", "-o", "actor_config.lr=1e-3",
                  # The untrained tiny model scores 0 everywhere (no advantage): the entropy bonus gives the update a
                  # gradient, so the adapters must move.
                  "-o", "rl_config.entropy_coeff=0.01")
    return proc, run_dir


@pytest.mark.slow  # CI runs the share_backbone run below (the upstream config's choice); this one in `make soak`
def test_lora_run_finishes_logs_metrics_and_pushes_each_update(lora_run: tuple) -> None:
    proc, run_dir = lora_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["actor/pg_loss"]) and m["grad_norm"] > 0
        assert m["timing/reference_model"] > 0 and m["timing/update"] > 0
        assert m["timing/resharding_to_infer"] > 0  # the update's merged weights went to the replica
    # By iteration 2 the actor's adapters have trained, and the reference (its own trainer, the base weights) is
    # left behind.
    assert metrics[1]["actor/kl_loss"] > 0
    # Each update makes the next weights version, which the replica must serve for the next iteration's samples.
    versions = [m["weights_version"] for m in metrics]
    assert versions[0] >= 2 and versions[1] == versions[0] + 1
    assert "iteration 2/2" in proc.stdout and "RUN_PHASE_DONE" in proc.stdout


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapters_only(lora_run: tuple) -> None:
    proc, run_dir = lora_run
    assert proc.returncode == 0
    files = list((run_dir / "ckpt" / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt"))
    assert len(files) == 1, files
    payload = torch.load(files[0], map_location="cpu", weights_only=False)
    names = sorted(payload["model"])
    assert names and all(is_adapter_name(n) for n in names)
    assert {n.rsplit(".", 3)[-3] for n in names} == set(TARGET_KINDS)
    assert payload["rlfabric"]["adapters_only"] is True
    # Trained: some B moved off its zero start.
    assert any(n.endswith("lora_B.weight") and payload["model"][n].abs().max() > 0 for n in names)


# ---- share_backbone: the reference is the actor's backbone with its adapters off (MindSpeed-RL's LoRA config) ----
@pytest.fixture(scope="module")
def shared_run(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("lora_shared_up")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir, *LORA,
                  "-o", "rl_config.share_backbone=true", "-o", "rl_config.use_integrated_worker=true",
                  "-o", "generate_config.offload_train_param=true",
                  "-o", "megatron_training.train_iters=2", "-o", "megatron_training.save_interval=2",
                  "-o", "rl_config.mini_batch_size=4", "-o", "actor_config.lr=1e-3",
                  "-o", "rl_config.entropy_coeff=0.01")
    return proc, run_dir


def test_share_backbone_runs_without_a_reference_trainer(shared_run: tuple) -> None:
    proc, run_dir = shared_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = sorted(p.name for p in (run_dir / "logs").glob("trainer-*.log"))
    assert logs == ["trainer-actor.log"]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["timing/reference_model"] > 0 and m["grad_norm"] > 0
        assert m["timing/resharding_to_infer"] > 0
    # The reference pass ran on the actor with its adapters off: by iteration 2 the adapters have trained, and the
    # backbone (the reference) stayed behind.
    assert metrics[1]["actor/kl_loss"] > 0
    versions = [m["weights_version"] for m in metrics]
    assert versions[1] == versions[0] + 1
    files = list((run_dir / "ckpt" / "iter_0000002").glob("mp_rank_*/model_optim_rng.pt"))
    payload = torch.load(files[0], map_location="cpu", weights_only=False)
    assert payload["rlfabric"]["adapters_only"] is True and all(is_adapter_name(n) for n in payload["model"])
