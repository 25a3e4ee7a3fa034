"""Trainer options from a MindSpeed-RL YAML (configs/{grpo,dapo}_tiny_cpu.yaml): keys and derived values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config, load_config_dict
from services.trainer import ckpt_layout
from services.trainer.optimizer import OptimizerOptions
from services.trainer.options import update_options_from_config, worker_options_from_config
from services.trainer.update import UpdateOptions

# The keys a config must set (and a model shape); every other key at the schema's default.
_MINIMAL_CONFIG = {
    "megatron_training": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "global_batch_size": 8,
                          "micro_batch_size": 1, "seq_length": 1024, "train_iters": 7, "lr": 1e-6,
                          "attention_dropout": 0.0, "hidden_dropout": 0.0},
    "rl_config": {"actor_resource": {"num_npus": 1}},
    "generate_config": {"infer_tensor_parallel_size": 1},
}


def test_actor_options_follow_the_yaml_keys(repo_root: Path, tiny_model_dir: Path):
    cfg = load_config(repo_root / "configs/dapo_tiny_cpu.yaml", overrides=[
        f"actor_config.load={tiny_model_dir}", "rl_config.clip_ratio_high=0.3", "rl_config.shuffle_mini_batch=true",
        "rl_config.mini_batch_size=4", "rl_config.actor_forward_micro_batch_size=8"])
    opts, kl_coef = worker_options_from_config(cfg, "actor")
    assert kl_coef == cfg.rl_config.init_kl_coef
    assert opts.update.use_kl is False  # DAPO: no KL term
    assert opts.update.mini_batch_rows == 4 * cfg.rl_config.n_samples_per_prompt
    assert opts.update.micro_batch_size == cfg.actor_config.micro_batch_size
    assert opts.update.shuffle_mini_batch is True
    assert (opts.update.clip_ratio_low, opts.update.clip_ratio_high) == (cfg.rl_config.clip_ratio_low, 0.3)
    assert opts.optimizer.lr == cfg.actor_config.lr and opts.optimizer.adam_beta2 == cfg.actor_config.adam_beta2
    assert opts.params_dtype == cfg.derived.params_dtype == "float32"
    assert opts.forward_micro_batch_size == cfg.derived.actor_forward_micro_batch_size == 8
    assert opts.load == str(tiny_model_dir) and opts.hf_dir == cfg.actor_config.tokenizer_name_or_path


def test_reference_options_come_from_the_derived_values(repo_root: Path, tmp_path: Path):
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
        f"ref_config.load={tmp_path / 'initial'}", "ref_config.micro_batch_size=4", "ref_config.bf16=true",
        "rl_config.ref_forward_micro_batch_size=null"])
    opts, _ = worker_options_from_config(cfg, "reference")
    assert opts.load == cfg.derived.ref_model_load_path == str(tmp_path / "initial")
    assert opts.forward_micro_batch_size == cfg.derived.ref_forward_micro_batch_size == 4  # ref micro_batch_size
    assert opts.params_dtype == cfg.derived.ref_params_dtype == "bfloat16"
    assert opts.finetune is True and opts.role == "reference"


def test_reference_refuses_a_resumed_actor_checkpoint(repo_root: Path, tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    ckpt_layout.write_tracker(run, 12)
    # The config loader refuses: the reference would load the trained actor.
    with pytest.raises(ConfigError, match="ref_model_load_path"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml",
                    overrides=[f"actor_config.load={run}", "actor_config.finetune=false"])
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
        f"actor_config.load={run}", "actor_config.finetune=false",
        f"ref_config.load={tmp_path / 'initial'}"])
    opts, _ = worker_options_from_config(cfg, "reference")
    assert opts.load == str(tmp_path / "initial") and opts.finetune is True and opts.role == "reference"


def test_update_option_defaults_are_the_schemas() -> None:
    # A trainer without a config updates as one whose config leaves every update key at its default; only the two
    # values a config always gives (micro_batch_size is required, mini_batch_rows derived) are UpdateOptions' own.
    update = update_options_from_config(load_config_dict(_MINIMAL_CONFIG))
    assert dataclasses.replace(update, micro_batch_size=1, mini_batch_rows=0) == UpdateOptions()


def test_the_optimizer_takes_the_required_keys_as_given() -> None:
    opts, _ = worker_options_from_config(load_config_dict(_MINIMAL_CONFIG), "actor")
    assert (opts.optimizer.lr, opts.optimizer.train_iters, opts.optimizer.lr_warmup_iters) == (1e-6, 7, 0)
    assert opts.update.micro_batch_size == 1 and opts.forward_micro_batch_size == 1
    with pytest.raises(ConfigError, match="`train_iters` is not set"):
        load_config_dict({**_MINIMAL_CONFIG, "megatron_training": {
            k: v for k, v in _MINIMAL_CONFIG["megatron_training"].items() if k != "train_iters"}})


def test_the_reference_takes_no_update_keys(repo_root: Path) -> None:
    # Its own section (over megatron_training alone) sets neither lr nor micro_batch_size: nothing of the update is
    # read from it but the seed.
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=["ref_config.bf16=false"])
    assert cfg.ref_config.lr is None and cfg.ref_config.micro_batch_size is None
    opts, _ = worker_options_from_config(cfg, "reference")
    assert opts.update == UpdateOptions(seed=cfg.ref_config.seed) and opts.optimizer == OptimizerOptions()
    assert opts.forward_micro_batch_size == cfg.rl_config.ref_forward_micro_batch_size


def test_a_reference_without_a_forward_micro_batch_is_refused(repo_root: Path) -> None:
    with pytest.raises(ConfigError, match="the reference's forward micro-batch is not set"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml",
                    overrides=["ref_config.bf16=false", "rl_config.ref_forward_micro_batch_size=null"])
