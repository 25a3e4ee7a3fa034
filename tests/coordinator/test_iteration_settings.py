"""What one GRPO iteration takes from a MindSpeed-RL YAML (`settings_from_config`)."""

from __future__ import annotations

from pathlib import Path

from services.common.config import load_config
from services.coordinator.settings import settings_from_config


def test_reward_and_shaping_settings_from_a_mindspeed_yaml(repo_root: Path) -> None:
    config = load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml", overrides=[
        "rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=16", "rl_config.rollout_max_tokens=64",
        "rl_config.verifier_function=[math_17k_acc, format]", "rl_config.verifier_weight=[1.0, 0.5]"])
    s = settings_from_config(config)
    assert s.verifiers == (("math_17k_acc", 1.0), ("format", 0.5))
    assert (s.overlong_buffer_enable, s.rollout_max_tokens, s.overlong_buffer, s.overlong_buffer_penalty_factor) == (
        True, 64, 16, 1.0)


def test_sampling_kl_and_batch_settings_from_the_tiny_yaml(repo_root: Path) -> None:
    s = settings_from_config(load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml"))
    assert (s.n_samples_per_prompt, s.max_tokens, s.temperature, s.top_k) == (8, 64, 1.0, -1)
    assert s.use_reference and s.init_kl_coef == 0.001 and s.kl_ctrl_type == "fixed"
    assert s.kl_in_loss and not s.use_kl_in_reward  # GRPO: the KL is a loss term
    assert s.skip_old_log_probs  # mini_batch_size == global_batch_size and one epoch
    assert s.world_size == 3  # disaggregated: actor, reference and rollout on a device each (cfg.derived)


def test_dapo_and_integrated_settings(repo_root: Path) -> None:
    s = settings_from_config(load_config(repo_root / "configs" / "dapo_tiny_cpu.yaml", overrides=[
        "rl_config.filter_groups_max_batches=-1", "rl_config.filter_groups_train_batch_size=4",
        "rl_config.use_integrated_worker=true", "generate_config.offload_train_param=true",
        "generate_config.offload_train_optimizer=true"]))
    assert (s.filter_groups_enable, s.filter_groups_metric, s.filter_groups_max_batches,
            s.filter_groups_train_batch_size) == (True, "math_17k_acc", -1, 4)
    assert s.use_integrated_worker and s.world_size == 1  # integrated: the actor's device, shared
    assert not s.use_reference and not s.kl_in_loss  # DAPO: no KL term, no reference (cfg.derived.use_kl_loss)
    assert (s.offload_train_param, s.offload_train_grad, s.offload_train_optimizer) == (True, False, True)


def test_weight_transport_is_read_from_the_rlfabric_section(repo_root: Path) -> None:
    tiny = repo_root / "configs" / "grpo_tiny_cpu.yaml"
    assert settings_from_config(load_config(tiny)).weight_transport == "auto"
    chosen = settings_from_config(load_config(tiny, overrides=["rlfabric.weight_transport=collective"]))
    assert chosen.weight_transport == "collective"
