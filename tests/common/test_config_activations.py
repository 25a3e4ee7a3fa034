"""Activation-memory keys: recompute combinations checked as Megatron checks them, errors naming the key,
Megatron's silent cases as warnings, and the keys reaching the trainer's options."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.config.activations import recompute_problem
from services.common.config.catalog import key_report
from services.trainer.activation_memory import ActivationMemory
from services.trainer.options import worker_options_from_config

# configs/grpo_qwen25_7b_A3.yaml: 28 layers at PP 2, so 14 per stage; TP 2 with sequence_parallel.
UPSTREAM_7B = "configs/grpo_qwen25_7b_A3.yaml"


def _load(repo_root: Path, *overrides: str, path: str = UPSTREAM_7B):
    return load_config(repo_root / path, overrides=list(overrides))


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["recompute_granularity=full"], "recompute_method", "uniform or block"),
    (["recompute_granularity=full", "recompute_method=block"], "recompute_num_layers", "recompute_num_layers"),
    (["recompute_granularity=selective", "recompute_method=uniform"], "recompute_method", "selective"),
    (["recompute_granularity=selective", "recompute_num_layers=2"], "recompute_num_layers", "unset"),
    (["recompute_granularity=partial"], "recompute_granularity", "full or selective"),
    (["recompute_granularity=full", "recompute_method=blocks", "recompute_num_layers=1"], "recompute_method",
     "uniform or block"),
    (["recompute_granularity=full", "recompute_method=block", "recompute_num_layers=15"], "recompute_num_layers",
     "(14)"),
    (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=4"], "recompute_num_layers",
     "divide"),
    (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=0"], "recompute_num_layers",
     "at least 1"),
])
def test_bad_recompute_combinations_are_refused_naming_the_key(repo_root, overrides, key, words):
    with pytest.raises(ConfigError) as exc:
        _load(repo_root, *(f"megatron_training.{o}" for o in overrides))
    text = str(exc.value)
    assert f"megatron_training.{key}:" in text and words in text, text


@pytest.mark.parametrize("overrides", [
    ["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=7"],
    ["recompute_granularity=full", "recompute_method=block", "recompute_num_layers=14"],
    ["recompute_granularity=selective"],
    ["recompute_activation_function=true"],
])
def test_valid_recompute_settings_load_and_reach_the_trainer(repo_root, overrides):
    cfg = _load(repo_root, *(f"megatron_training.{o}" for o in overrides))
    opts, _ = worker_options_from_config(cfg, "actor")
    mem = opts.activation_memory
    assert (mem.recompute_granularity, mem.recompute_method, mem.recompute_num_layers,
            mem.recompute_activation_function) == (
        cfg.actor_config.recompute_granularity, cfg.actor_config.recompute_method,
        cfg.actor_config.recompute_num_layers, cfg.actor_config.recompute_activation_function)
    assert mem.sequence_parallel is True  # the upstream file sets it, at TP 2


def test_the_reference_gets_its_own_section(repo_root):
    cfg = _load(repo_root, "rl_config.use_integrated_worker=false", "rl_config.reference_resource={num_npus: 16}",
                "ref_config.sequence_parallel=false")
    actor, _ = worker_options_from_config(cfg, "actor")
    ref, _ = worker_options_from_config(cfg, "reference")
    assert actor.activation_memory.sequence_parallel is True and ref.activation_memory.sequence_parallel is False


def test_settings_megatron_ignores_are_warnings(repo_root):
    cfg = _load(repo_root, "megatron_training.recompute_method=block", "megatron_training.recompute_num_layers=2",
                "actor_config.tensor_model_parallel_size=1")
    text = "\n".join(cfg.warnings)
    assert "recompute_method and recompute_num_layers set without recompute_granularity" in text
    assert "megatron_training.sequence_parallel: sequence_parallel is true at tensor_model_parallel_size 1" in text


def test_upstream_configs_list_no_activation_key_as_inert(repo_root):
    upstream = (repo_root / ".." / "shared" / "reference" / "mindspeed_rl" / "configs").resolve()
    for name in ("grpo_qwen25_7b_A3", "grpo_qwen25_32b_A3", "grpo_qwen3_8b_A3"):
        cfg = load_config(upstream / f"{name}.yaml")
        inert = [k for keys in key_report(cfg, platform="cpu/cuda").inert.values() for k in keys]
        assert not [k for k in inert if k.rsplit(".", 1)[-1] in (
            "sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers",
            "recompute_activation_function", "swap_attention")], (name, inert)


def test_swap_attention_is_reported_inactive_off_ascend(repo_root):
    cfg = _load(repo_root, "megatron_training.swap_attention=true")
    assert key_report(cfg, platform="cpu/cuda").inactive_here == {"megatron_training.swap_attention": "ascend"}
    assert key_report(cfg, platform="ascend").inactive_here == {}


def test_one_rule_for_the_config_and_the_trainer():
    assert recompute_problem(None, "block", 3) is None  # Megatron ignores a method without a granularity
    assert recompute_problem("full", "block", 3, layers_per_stage=3) is None
    assert recompute_problem("full", "uniform", 2, layers_per_stage=3)[0] == "recompute_num_layers"
    with pytest.raises(ValueError, match="recompute_method"):
        ActivationMemory(recompute_granularity="selective", recompute_method="uniform")
