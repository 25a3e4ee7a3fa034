"""Each cross-field rule fires, with a message that names the keys, the numbers and the fix.

Every case starts from the shipped 7B config (16 devices, TP2 x PP2 -> DP 4, gbs 32, n 8,
micro 4, mini 32, max_model_len 4096, max_tokens 2048) and breaks one thing with overrides.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config

CASES = [
    ("weight_transport", ["rlfabric.weight_transport=nccl"], "rlfabric.weight_transport",
     ["must be auto, grpc or collective", "'nccl'"]),
    # (id, overrides, key of the reported issue, substrings of its message)
    ("max_model_len<seq_length", ["megatron_training.seq_length=8192"], "generate_config.max_model_len",
     ["max_model_len (4096) is smaller than seq_length (8192)", "raise max_model_len to at least 8192"]),
    ("prompt>=max_model_len", ["rl_config.max_prompt_length=4097"], "generate_config.max_model_len",
     ["max_prompt_length - 1 = 4096", "leaves no room for a response", "raise max_model_len above 4096"]),
    ("devices%(tp*pp*cp)", ["rl_config.actor_resource.num_npus=6"], "rl_config.actor_resource.num_npus",
     ["num_npus (6) must be divisible by tensor x pipeline x context parallel size (2 x 2 x 1 = 4)"]),
    ("(gbs*n)%micro", ["actor_config.micro_batch_size=3"], "actor_config.micro_batch_size",
     ["32 x 8 = 256 samples must be divisible by micro_batch_size (3)"]),
    ("gbs%dp", ["megatron_training.global_batch_size=30", "rl_config.mini_batch_size=2",
                "generate_config.infer_tensor_parallel_size=8"], "megatron_training.global_batch_size",
     ["global_batch_size (30) must be divisible by the actor data-parallel size 4", "use a multiple of 4 prompts"]),
    ("gbs%rollout_dp", ["megatron_training.global_batch_size=8", "rl_config.mini_batch_size=8"],
     "megatron_training.global_batch_size", ["global_batch_size (8) must be divisible by the rollout data-parallel "
                                            "size 16 (= 16 devices / infer TP 1)"]),
    ("gbs%mini", ["rl_config.mini_batch_size=5"], "rl_config.mini_batch_size",
     ["global_batch_size (32) must be divisible by rl_config.mini_batch_size (5)"]),
    ("mini-per-rank%micro", ["rl_config.mini_batch_size=2", "actor_config.micro_batch_size=8"],
     "actor_config.micro_batch_size", ["mini_batch_size x n / DP = 2 x 8 / 4 = 4 samples",
                                       "divisible by micro_batch_size (8)"]),
    ("dispatch-size", ["rl_config.actor_logprob_dispatch_size=7"], "rl_config.actor_logprob_dispatch_size",
     ["(7) must divide the samples per iteration, global_batch_size x n = 256"]),
    ("update-dispatch-too-small", ["rl_config.actor_update_dispatch_size=32"], "rl_config.actor_update_dispatch_size",
     ["must be at least mini_batch_size x n / DP = 256 / 4 = 64"]),
    ("verifier-lengths", ["rl_config.verifier_weight=[1.0, 0.5]"], "rl_config.verifier_weight",
     ["verifier_function has 1 entries", "verifier_weight has 2", "one weight per verifier"]),
    ("verifier-empty", ["rl_config.verifier_function=[]", "rl_config.verifier_weight=[]"],
     "rl_config.verifier_function", ["verifier_function is empty"]),
    ("clip-higher", ["rl_config.clip_higher_enable=true", "rl_config.clip_ratio_low=0.3",
                     "rl_config.clip_ratio_high=0.2"], "rl_config.clip_ratio_low",
     ["clip_ratio_low (0.3) greater than clip_ratio_high (0.2)", "clip_ratio_low <= clip_ratio_high"]),
    ("overlong>=max_tokens", ["rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=2048"],
     "rl_config.overlong_buffer", ["overlong_buffer (2048) must be between 1 and sampling_config.max_tokens - 1 (2047)"]),
    ("overlong-rollout_max_tokens", ["rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=512",
                                     "rl_config.rollout_max_tokens=1024"], "rl_config.rollout_max_tokens",
     ["rollout_max_tokens (1024) must equal generate_config.sampling_config.max_tokens (2048)"]),
    ("infer-pp", ["generate_config.infer_pipeline_parallel_size=2"], "generate_config.infer_pipeline_parallel_size",
     ["`generate_config.infer_pipeline_parallel_size` is 2", "without pipeline parallelism"]),
    ("infer-tp-devices", ["generate_config.infer_tensor_parallel_size=3"], "generate_config.infer_tensor_parallel_size",
     ["num_npus (16) must be divisible by generate_config.infer_tensor_parallel_size (3)"]),
    ("kl_penalty", ["rl_config.kl_penalty=k4"], "rl_config.kl_penalty",
     ["unsupported rl_config.kl_penalty `k4`; supported: low_var_kl, kl, abs, mse"]),
    ("kl_ctrl_type", ["rl_config.kl_ctrl_type=pid"], "rl_config.kl_ctrl_type", ["supported: fixed, adaptive"]),
    ("adv_estimator", ["rl_config.adv_estimator=gae"], "rl_config.adv_estimator",
     ["rl_config.adv_estimator `gae` needs a critic", "stage: ray_ppo"]),
    ("clip_ratio", ["rl_config.clip_ratio=0"], "rl_config.clip_ratio", ["clip_ratio must be positive, got 0.0"]),
    ("heads%tp", ["actor_config.tensor_model_parallel_size=8", "rl_config.actor_resource.num_npus=32"],
     "actor_config.tensor_model_parallel_size", ["num_attention_heads (28) must be divisible by "
                                                 "tensor_model_parallel_size (8)"]),
    ("kv-heads%tp", ["actor_config.tensor_model_parallel_size=7", "actor_config.pipeline_model_parallel_size=1",
                     "rl_config.actor_resource.num_npus=14", "megatron_training.global_batch_size=28",
                     "rl_config.mini_batch_size=28", "generate_config.infer_tensor_parallel_size=1"],
     "actor_config.tensor_model_parallel_size", ["num_query_groups (4) must be divisible by tensor_model_parallel_size (7)"]),
    ("layers%pp", ["actor_config.pipeline_model_parallel_size=8", "actor_config.tensor_model_parallel_size=1"],
     "actor_config.pipeline_model_parallel_size", ["num_layers (28) must be divisible by pipeline_model_parallel_size (8)"]),
    ("temperature", ["generate_config.sampling_config.temperature=0"], "generate_config.sampling_config.temperature",
     ["temperature must be positive"]),
    ("top_p", ["generate_config.sampling_config.top_p=1.5"], "generate_config.sampling_config.top_p",
     ["top_p must be in (0, 1], got 1.5"]),
    ("dtype", ["generate_config.dtype=int8"], "generate_config.dtype", ["unsupported generate_config.dtype `int8`"]),
    ("gpu_memory_utilization", ["generate_config.gpu_memory_utilization=0"], "generate_config.gpu_memory_utilization",
     ["must be in (0, 1], got 0.0"]),
    ("batched_tokens<seqs", ["generate_config.max_num_batched_tokens=512"], "generate_config.max_num_batched_tokens",
     ["max_num_batched_tokens (512) must be at least max_num_seqs (1024)"]),
    ("lr_decay_style", ["actor_config.lr_decay_style=step"], "actor_config.lr_decay_style",
     ["unsupported lr_decay_style `step`"]),
    ("backend", ["megatron_training.distributed_backend=mpi"], "megatron_training.distributed_backend",
     ["unsupported distributed_backend `mpi`"]),
    ("positive", ["rl_config.epochs=0"], "rl_config.epochs", ["`rl_config.epochs` must be at least 1, got 0"]),
    ("reward-model", ["rl_config.rule_reward=false"], "rl_config.rule_reward",
     ["rlfabric does not support reward models", "`rl_config.rule_reward`"]),
    ("integrated+reference_resource", ["rl_config.reference_resource.num_npus=8"], "rl_config.reference_resource",
     ["reference_resource is set while use_integrated_worker is true"]),
    ("integrated_mode_config-off", ["rl_config.use_integrated_worker=false",
                                    "rl_config.integrated_mode_config.ref_model_load_path=./base"],
     "rl_config.integrated_mode_config", ["integrated_mode_config is set while use_integrated_worker is false"]),
    ("filter-metric", ["rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=acc_for_dapo",
                       "rl_config.filter_groups_train_batch_size=32"], "rl_config.filter_groups_metric",
     ["filter_groups_metric `acc_for_dapo` is not one of verifier_function ['math_17k_acc']"]),
    ("filter-train-batch%dp", ["rl_config.filter_groups_enable=true", "rl_config.filter_groups_metric=math_17k_acc",
                               "rl_config.filter_groups_train_batch_size=6"], "rl_config.filter_groups_train_batch_size",
     ["filter_groups_train_batch_size (6) must be divisible by the actor data-parallel size 4"]),
    ("partial-rollout<1", ["rl_config.partial_rollout_max_split=0"], "rl_config.partial_rollout_max_split",
     ["rl_config.partial_rollout_max_split must be at least 1", "got 0"]),
    ("partial-rollout-negative", ["rl_config.partial_rollout_max_split=-2"], "rl_config.partial_rollout_max_split",
     ["rl_config.partial_rollout_max_split must be at least 1", "got -2"]),
    ("max_tokens%partial-rollout", ["rl_config.partial_rollout_max_split=3"], "rl_config.partial_rollout_max_split",
     ["partial_rollout_max_split (3) must divide generate_config.sampling_config.max_tokens (2048)",
      "max_tokens // 3 tokens", "(e.g. 2046)"]),
    ("partial-rollout+multi-turn", ["rl_config.partial_rollout_max_split=2", "rl_config.multi_turn_enable=true"],
     "rl_config.partial_rollout_max_split",
     ["partial_rollout_max_split (2) asks for partial rollout with multi-turn rollouts",
      "set partial_rollout_max_split: 1, or set multi_turn_enable: false"]),
    ("lora", ["actor_config.lora_target_modules=[linear_qkv,lm_head]"], "actor_config.lora_target_modules",
     ["names ['lm_head']", "the valid names are"]),
    ("wandb", ["rl_config.use_wandb=true"], "rl_config.wandb_project", ["wandb_project is empty"]),
    ("swanlab", ["rl_config.use_swanlab=true", "rl_config.swanlab_project=p"], "rl_config.swanlab_exp_name",
     ["use_swanlab is true but swanlab_exp_name is empty"]),
    ("rollout-dp-mismatch", ["generate_config.data_parallel_size=3"], "generate_config.data_parallel_size",
     ["data_parallel_size (3) disagrees with devices / infer TP = 16"]),
]


@pytest.fixture(scope="module")
def upstream_7b(repo_root: Path) -> Path:
    return repo_root / "configs" / "grpo_qwen25_7b_A3.yaml"


@pytest.mark.parametrize(("overrides", "key", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_fires_with_helpful_message(upstream_7b: Path, overrides: list[str], key: str, needles: list[str]):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=overrides)
    matching = [issue for issue in exc.value.issues if issue.key == key]
    assert matching, f"no issue for {key}; got:\n{exc.value}"
    message = " | ".join(issue.message for issue in matching)
    for needle in needles:
        assert needle in message


def test_rule_issue_points_at_the_line_that_set_the_key(upstream_7b: Path, tmp_path: Path, repo_root: Path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "qwen25_7b.yaml").write_text((repo_root / "configs/model/qwen25_7b.yaml").read_text())
    text = upstream_7b.read_text().replace("  micro_batch_size: 4", "  micro_batch_size: 3")
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    line = text.splitlines().index("  micro_batch_size: 3") + 1
    assert exc.value.issues[0].source == f"{path}:{line}"
    assert exc.value.issues[0].key == "actor_config.micro_batch_size"


def test_required_keys_are_reported(tmp_path: Path):
    path = tmp_path / "cfg.yaml"
    path.write_text("rl_config: {n_samples_per_prompt: 4}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    errors = "\n".join(exc.value.errors)
    for key in ("global_batch_size", "micro_batch_size", "seq_length", "train_iters", "lr"):
        assert f"`{key}` is not set; set it in `megatron_training` or `actor_config`" in errors
    assert "rl_config.actor_resource.num_npus` is not set" in errors
    assert "model architecture incomplete" in errors


def test_resume_with_reference_weights_is_accepted(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=["actor_config.finetune=false",
                                              "rl_config.integrated_mode_config.ref_model_load_path=./base"])
    assert cfg.derived.ref_model_load_path == "./base"


def test_type_error_suppresses_rules_about_the_same_key(upstream_7b: Path):
    # A bad global_batch_size is reported once, not again by every batch-size rule.
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=["megatron_training.global_batch_size=lots",
                                            "actor_config.micro_batch_size=3"])
    assert [i.key for i in exc.value.issues] == ["megatron_training.global_batch_size"]


def test_ref_config_in_integrated_mode_is_refused(upstream_7b: Path):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=["ref_config.micro_batch_size=2"])
    assert "ref_config is set while rl_config.use_integrated_worker is true" in str(exc.value)


def test_disaggregated_reference_gets_its_own_view(upstream_7b: Path):
    cfg = load_config(upstream_7b, overrides=[
        "rl_config.use_integrated_worker=false", "ref_config.tensor_model_parallel_size=1",
        "ref_config.pipeline_model_parallel_size=1", "ref_config.micro_batch_size=8",
        "rl_config.reference_resource.num_npus=8"])
    assert cfg.ref_config.tensor_model_parallel_size == 1 and cfg.ref_config.micro_batch_size == 8
    assert cfg.ref_config.hidden_size == 3584 and cfg.ref_config.seq_length == 2048  # model block + megatron_training
    assert cfg.ref_config.lr is None  # actor_config does not leak into the reference
    assert cfg.derived.ref_data_parallel_size == 8 and cfg.derived.ref_dispatch_size == 256 // 8


def test_reward_config_is_refused(upstream_7b: Path):
    with pytest.raises(ConfigError) as exc:
        load_config(upstream_7b, overrides=["reward_config.micro_batch_size=1"])
    assert [i.key for i in exc.value.issues] == ["reward_config"]
    assert "rlfabric does not support reward models" in str(exc.value)


def test_prompts_without_room_for_max_tokens_are_a_warning_and_get_what_max_model_len_leaves(repo_root: Path) -> None:
    """Upstream's vLLM stops at max_model_len (grpo_deepseek_r1_671b_A2: prompts to 8195 tokens, max_tokens 2048,
    max_model_len 10240); the coordinator asks the rollout for what is left, which the rollout then honours."""
    from services.coordinator.settings import settings_from_config

    cfg = load_config(repo_root / "configs" / "grpo_qwen25_7b_A3.yaml", overrides=["rl_config.max_prompt_length=3000"])
    (warning,) = [w for w in cfg.warnings if "max_model_len" in w]
    assert "prompts of more than 2048 tokens (max_model_len 4096 - max_tokens 2048; max_prompt_length allows 2999)" \
        in warning and "finish reason length" in warning
    s = settings_from_config(cfg)
    assert [s.response_budget(n) for n in (1, 2048, 2049, 2999, 4095)] == [2048, 2048, 2047, 1097, 1]
    assert s.response_budget(4096) == 2048  # no room at all: the rollout fails the sample, naming max_model_len
    assert not [w for w in load_config(repo_root / "configs" / "grpo_qwen25_7b_A3.yaml").warnings
                if "max_model_len" in w]
