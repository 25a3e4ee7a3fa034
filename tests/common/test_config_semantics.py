"""MindSpeed-RL's meaning of a config: the algorithm a stage selects, the features rlfabric refuses, resume,
the derived world size and skip rule, upstream defaults, and every upstream GRPO/DAPO config loading unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.common.config import (
    DEFAULT_VERIFIER_FUNCTION,
    ConfigError,
    GenerateConfig,
    RLConfig,
    load_config,
    load_config_dict,
)
from services.common.config.catalog import key_report
from services.common.config.resume import checkpoint_iteration
from services.common.config.yaml_io import read_yaml

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "reference" / "mindspeed_rl" / "configs"
SEVEN_B = REPO / "configs" / "grpo_qwen25_7b_A3.yaml"
DAPO_32B = UPSTREAM / "dapo_qwen25_32b_A3.yaml"


def _load_upstream_text(tmp_path: Path, name: str, text: str):
    """A config text beside a copy of the upstream model files."""
    (tmp_path / "model").mkdir(exist_ok=True)
    for src in (UPSTREAM / "model").glob("*.yaml"):
        (tmp_path / "model" / src.name).write_text(src.read_text())
    path = tmp_path / name
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("path", sorted(UPSTREAM.glob("*.yaml")), ids=lambda p: p.name)
def test_every_upstream_config_loads_unchanged(path: Path):
    cfg = load_config(path)
    assert cfg.derived.algorithm in ("grpo", "dapo")


def test_dapo_has_no_kl_term_and_no_reference_model():
    cfg = load_config(DAPO_32B)
    d = cfg.derived
    assert (d.algorithm, d.use_kl_loss, d.ref_world_size, d.ref_data_parallel_size) == ("dapo", False, None, None)
    assert d.dynamic_sampling and d.train_prompts_per_iteration == 32
    assert d.world_size == 16  # integrated: actor and rollout share the actor's 16 devices
    assert "rl_config.init_kl_coef" not in cfg.provenance.sources and cfg.rl_config.init_kl_coef == 0.01


def test_grpo_configs_keep_their_kl_term():
    cfg = load_config(SEVEN_B)
    assert (cfg.derived.algorithm, cfg.derived.use_kl_loss, cfg.derived.ref_world_size) == ("grpo", True, 16)
    no_kl = load_config(SEVEN_B, overrides=["rl_config.init_kl_coef=0"])
    assert not no_kl.derived.use_kl_loss and no_kl.derived.ref_world_size is None


def test_dapo_refuses_an_explicit_kl_coefficient_and_accepts_zero():
    with pytest.raises(ConfigError) as exc:
        load_config(DAPO_32B, overrides=["rl_config.init_kl_coef=0.05"])
    assert [i.key for i in exc.value.issues] == ["rl_config.init_kl_coef"]
    assert "MindSpeed-RL's DAPO has no KL term and no reference model" in str(exc.value)
    assert not load_config(DAPO_32B, overrides=["rl_config.init_kl_coef=0.0"]).derived.use_kl_loss


@pytest.mark.parametrize(("override", "what"), [
    ("rl_config.clip_higher_enable=true", "clip-higher"),
    ("rl_config.token_level_loss=false", "sequence-mean-token-mean loss"),
    ("rl_config.filter_groups_enable=true", "dynamic sampling"),
])
def test_grpo_refuses_dapo_only_switches(override: str, what: str):
    with pytest.raises(ConfigError) as exc:
        load_config(SEVEN_B, overrides=[override, "rl_config.filter_groups_metric=math_17k_acc",
                                        "rl_config.filter_groups_train_batch_size=32"])
    assert [i.key for i in exc.value.issues] == [override.split("=")[0]]
    assert f"asks for DAPO's {what}" in str(exc.value) and "stage: ray_dapo" in str(exc.value)


@pytest.mark.parametrize(("stage", "feature"), [("dpo", "DPO"), ("ray_dpo", "DPO")])
def test_other_algorithms_are_refused_with_one_message_naming_them(stage: str, feature: str):
    with pytest.raises(ConfigError) as exc:
        load_config(SEVEN_B, overrides=[f"megatron_training.stage={stage}"])
    assert len(exc.value.issues) == 1
    assert f"rlfabric does not support {feature}" in str(exc.value) and f"stage: {stage}" in str(exc.value)


def test_an_unknown_stage_is_refused():
    with pytest.raises(ConfigError, match="stage `ray_reinforce` is not an algorithm rlfabric trains"):
        load_config(SEVEN_B, overrides=["megatron_training.stage=ray_reinforce"])


def test_a_critic_config_key_is_checked_like_the_other_megatron_sections(tmp_path: Path):
    text = SEVEN_B.read_text().replace("stage: ray_grpo", "stage: ray_ppo").replace("adv_estimator: group_norm", "")
    text += "\ncritic_config:\n  micro_batch_size: 1\n  made_up_critic_key: 3\n"
    with pytest.raises(ConfigError, match="critic_config.made_up_critic_key"):
        _load_upstream_text(tmp_path, "ppo.yaml", text)


def test_vllm_ascend_keys_are_accepted_passed_on_and_inactive_here():
    cfg = load_config(UPSTREAM / "grpo_qwen25_32b_A3.yaml", overrides=[
        "generate_config.torchair_graph=true", "generate_config.expert_map_path=/maps/x.json",
        "generate_config.enable_expert_parallel=false"])
    extra = cfg.generate_config.vllm_additional_config()
    assert extra["ascend_scheduler_config"] == {"enabled": False}  # the file sets false
    assert extra["torchair_graph_config"]["enabled"] is True
    assert extra["torchair_graph_config"]["graph_batch_sizes"] == [cfg.generate_config.max_num_seqs]
    assert extra["expert_map_path"] == "/maps/x.json"
    report = key_report(cfg, platform="cpu/cuda")
    assert set(report.inactive_here) == {"generate_config.ascend_scheduler_config_enabled",
                                         "generate_config.torchair_graph", "generate_config.expert_map_path"}
    assert key_report(cfg, platform="ascend").inactive_here == {}


def test_key_report_lists_inert_and_algorithm_inactive_keys():
    report = key_report(load_config(DAPO_32B), platform="cpu/cuda")
    inert = {key for keys in report.inert.values() for key in keys}
    assert "megatron_training.use_flash_attn" in inert
    # Integrated mode and dynamic sampling are implemented (services/coordinator): read, so not listed.
    assert not {"rl_config.use_integrated_worker", "rl_config.filter_groups_enable",
                "generate_config.offload_train_param"} & inert
    assert "rl_config.clip_ratio" in report.inactive_for_algorithm  # clip-higher replaces it
    assert "rl_config.n_samples_per_prompt" not in inert  # read keys are not listed


def _checkpoint(root: Path, tracker: str | None = None, iter_dirs: tuple[int, ...] = ()) -> Path:
    root.mkdir(parents=True)
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    for i in iter_dirs:
        (root / f"iter_{i:07d}").mkdir()
    return root


def test_checkpoint_iteration_reads_megatron_trackers(tmp_path: Path):
    assert checkpoint_iteration(_checkpoint(tmp_path / "a", "release")) == 0
    assert checkpoint_iteration(_checkpoint(tmp_path / "b", "12")) == 12
    assert checkpoint_iteration(_checkpoint(tmp_path / "c", None, (3, 5))) == 5
    assert checkpoint_iteration(_checkpoint(tmp_path / "d")) is None
    assert checkpoint_iteration(tmp_path / "missing") is None


@pytest.mark.parametrize(("tracker", "iter_dirs", "refused"), [
    ("release", (), False), ("0", (), False), (None, (), False), ("12", (), True), (None, (5,), True)])
def test_finetune_false_is_refused_only_for_a_trained_checkpoint(tmp_path: Path, tracker, iter_dirs, refused: bool):
    load = _checkpoint(tmp_path / "ckpt", tracker, iter_dirs)
    overrides = ["actor_config.finetune=false", f"actor_config.load={load}"]
    if refused:
        with pytest.raises(ConfigError, match="a checkpoint trained to iteration"):
            load_config(SEVEN_B, overrides=overrides)
    else:
        assert load_config(SEVEN_B, overrides=overrides).derived.ref_model_load_path == str(load)


def test_a_trained_checkpoint_resumes_with_reference_weights_or_without_a_reference(tmp_path: Path):
    load = _checkpoint(tmp_path / "ckpt", "12")
    resumed = ["actor_config.finetune=false", f"actor_config.load={load}"]
    cfg = load_config(SEVEN_B, overrides=[*resumed, "rl_config.integrated_mode_config.ref_model_load_path=/base"])
    assert cfg.derived.ref_model_load_path == "/base"
    assert not load_config(DAPO_32B, overrides=resumed).derived.use_kl_loss  # DAPO: no reference to load


def test_skip_old_log_probs_is_one_step_over_the_trained_prompts():
    def skip(*overrides: str) -> bool:
        return load_config(SEVEN_B, overrides=list(overrides)).derived.skip_old_log_probs

    assert skip()  # mini_batch_size == global_batch_size == 32, one epoch
    assert not skip("rl_config.mini_batch_size=16")
    assert not skip("rl_config.epochs=2")
    # DAPO dynamic sampling trains filter_groups_train_batch_size prompts (MindSpeed-RL's skip flag counts them).
    assert load_config(DAPO_32B).derived.skip_old_log_probs
    assert not load_config(DAPO_32B, overrides=["rl_config.filter_groups_train_batch_size=16"]).derived.skip_old_log_probs
    assert load_config(DAPO_32B, overrides=["rl_config.filter_groups_train_batch_size=16",
                                            "rl_config.mini_batch_size=16"]).derived.skip_old_log_probs


def test_world_size_counts_every_device_the_run_uses():
    tiny = REPO / "configs" / "grpo_tiny_cpu.yaml"
    assert load_config(tiny).derived.world_size == 3  # disaggregated: actor 1 + reference 1 + rollout 1
    assert load_config(REPO / "configs" / "dapo_tiny_cpu.yaml").derived.world_size == 2  # no reference
    assert load_config(tiny, overrides=["rl_config.use_integrated_worker=true"]).derived.world_size == 1
    assert load_config(SEVEN_B).derived.world_size == 16  # integrated
    split = load_config(SEVEN_B, overrides=["rl_config.use_integrated_worker=false",
                                            "rl_config.reference_resource.num_npus=8"])
    assert split.derived.world_size == 16 + 8 + 16


def test_defaults_are_mindspeed_rl_defaults():
    # Read from MindSpeed-RL's config classes (rl_config.py, generate_config.py).
    assert RLConfig().init_kl_coef == 0.01 and RLConfig().verifier_function == ["base_acc"]
    assert DEFAULT_VERIFIER_FUNCTION == ("base_acc",)
    g = GenerateConfig()
    assert (g.trust_remote_code, g.ascend_scheduler_config_enabled, g.torchair_graph, g.enable_expert_parallel,
            g.expert_map_path) == (False, True, False, False, None)


def test_unset_dropout_is_refused_because_rlfabric_trains_without():
    data = read_yaml(SEVEN_B)
    for key in ("attention_dropout", "hidden_dropout"):
        del data["megatron_training"][key]
    with pytest.raises(ConfigError) as exc:
        load_config_dict(data, base_dir=SEVEN_B.parent)
    assert "`megatron_training.attention_dropout` is 0.1 (MindSpeed-RL's default)" in str(exc.value)
    assert "set it to 0.0" in str(exc.value)


def test_dataclass_fields_match_the_sections_they_parse():
    assert {f.name for f in dataclasses.fields(GenerateConfig)} >= {
        "ascend_scheduler_config_enabled", "enable_expert_parallel", "torchair_graph", "expert_map_path",
        "eplb_token_collects", "eplb_token_save_path", "limit_mm_image_per_prompt", "limit_mm_video_per_prompt"}
