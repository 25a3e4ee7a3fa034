"""LoRA wired into the trainer: options from the config's LoRA keys, and an actor TrainerWorker with adapters
(tests/trainer/lora_worker_checks.py, one gloo rank): only the adapters train, the weight export is the merged
model under the base names, with the adapters off it is the base bitwise (share_backbone's reference; a trainer
without adapters refuses that with FAILED_PRECONDITION), and checkpoints with and without lora_ckpt_filter resume
exactly."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from trainer_helpers import run_ranks

from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.config import ConfigError, load_config
from services.common.config.lora import TARGET_NAMES
from services.common.sequences import Sequences
from services.trainer.lora import TARGET_KINDS, LoraOptions, is_adapter_name
from services.trainer.options import worker_options_from_config

LAYERS = 2
LORA_OVERRIDES = ["megatron_training.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
                  "megatron_training.lora_r=4", "megatron_training.lora_alpha=8",
                  "megatron_training.lora_ckpt_filter=true", "megatron_training.lora_fusion=true"]


def test_config_names_the_targets_the_trainer_adapts():
    assert TARGET_NAMES == tuple(TARGET_KINDS)


def test_actor_options_carry_lora_and_the_reference_never_does(repo_root: Path):
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=LORA_OVERRIDES)
    actor, _ = worker_options_from_config(cfg, "actor")
    assert actor.lora == LoraOptions(rank=4, alpha=8.0, target_modules=tuple(TARGET_KINDS), seed=cfg.actor_config.seed)
    assert actor.lora.scaling == 2.0 and actor.lora_ckpt_filter is True
    reference, _ = worker_options_from_config(cfg, "reference")
    assert reference.lora is None and reference.lora_ckpt_filter is False


def test_without_target_modules_lora_is_off(repo_root: Path):
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=["megatron_training.lora_r=16"])
    actor, _ = worker_options_from_config(cfg, "actor")
    assert actor.lora is None and actor.lora_ckpt_filter is False


@pytest.mark.parametrize(("override", "names"), [
    ("megatron_training.lora_target_modules=[linear_qkv,q_proj]", ["q_proj", "linear_fc2"]),
    ("megatron_training.lora_r=0", ["lora_r", "positive"]),
    ("megatron_training.lora_alpha=-8", ["lora_alpha", "positive"]),
    ("megatron_training.lora_target_modules=[]", ["lora_target_modules", "empty"]),
])
def test_bad_lora_values_are_refused_by_name(repo_root: Path, override: str, names: list[str]):
    overrides = [o for o in LORA_OVERRIDES if not o.startswith(override.split("=")[0] + "=")] + [override]
    with pytest.raises(ConfigError) as e:
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=overrides)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_ckpt_filter_without_lora_is_refused(repo_root: Path):
    with pytest.raises(ConfigError, match="lora_ckpt_filter.*LoRA is off"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=["megatron_training.lora_ckpt_filter=true"])


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("lora_worker")
    run_ranks("lora_worker_checks.py", 1, ["--hf", str(tiny_model_dir), "--work", str(work)])
    return torch.load(work / "lora_worker.pt", weights_only=False)


def test_the_optimizer_holds_the_adapters_only_and_an_update_moves_only_them(run):
    assert run["adapted_layers"] == LAYERS * len(TARGET_KINDS)
    assert len(run["adapter_names"]) == 2 * LAYERS * len(TARGET_KINDS)
    assert all(is_adapter_name(n) for n in run["adapter_names"])
    assert run["optimizer_names"] == run["adapter_names"]
    assert run["moved"] == run["adapter_names"]  # A and B of every layer, nothing of the base
    assert run["log_probs_moved"] > 1e-4


def test_with_adapters_off_the_trained_actor_is_the_base_bitwise(run):
    assert run["adapters_off_is_base"]


def test_adapters_off_on_a_trainer_without_lora_is_a_failed_precondition(start_trainer, tiny_model_dir: Path):
    _, address = start_trainer("--hf-dir", str(tiny_model_dir), "--tp", "1")
    seqs = Sequences.from_lists(["s0"], [np.arange(2, 7)], [np.arange(7, 11)], 0)
    req = trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=1.0, adapters_off=True)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        list(trainer_pb2_grpc.TrainerStub(channel).ComputeLogProbs(iter([req]), timeout=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no LoRA adapters" in e.value.details()


def test_the_export_is_the_merged_model_under_the_base_names(run):
    assert run["export_names_equal"]
    assert run["export_adapted_differs_from_base"]
    assert run["export_max_diff"] < 1e-6


@pytest.mark.parametrize("filtered", [False, True])
def test_checkpoints_resume_the_same_log_probs_and_training(run, filtered: bool):
    r = run[f"filter{int(filtered)}"]
    adapters = run["adapter_names"]
    if filtered:
        assert r["saved_keys"] == adapters and r["holds_adapters_only"]
    else:
        assert set(adapters) < set(r["saved_keys"]) and not r["holds_adapters_only"]
        assert "embedding.word_embeddings.weight" in r["saved_keys"]
    assert r["log_probs_equal"]
    assert r["resumed_iteration"] == 2
    assert r["resumed_optimizer_names"] == adapters
    assert r["resume_max_abs_diff"] < 1e-7


def test_a_filtered_checkpoint_is_a_fraction_of_a_full_one(run):
    assert 0 < run["filter1"]["saved_bytes"] < run["filter0"]["saved_bytes"] / 2
