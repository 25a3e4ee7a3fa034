"""MindSpeed-RL's PPO config (configs/ppo_qwen25_32b_A3.yaml upstream) against rlfabric's config: it passes as it
is and means what it means upstream (a critic from critic_config over megatron_training, GAE with gamma / lam, the
value clip, no KL anywhere without use_kl_in_reward, the critic on devices of its own), and the PPO rules
(services/common/config/ppo.py) refuse the combinations upstream would run as another algorithm than written."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from tests.common.upstream_text import write_upstream

# github.com/Ascend/MindSpeed-RL configs/ppo_qwen25_32b_A3.yaml (commit c25365f7), byte for byte.
UPSTREAM_PPO_YAML = """\
defaults:
  - model:
      - qwen25_32b

megatron_training:
  model: qwen25_32b
  use_fused_rmsnorm: true
  use_mcore_models: true
  sequence_parallel: true
  use_flash_attn: true
  no_masked_softmax_fusion: true
  attention_softmax_in_fp32: true
  no_gradient_accumulation_fusion: true
  use_fused_swiglu: true
  use_fused_rotary_pos_emb: true
  bf16: true
  use_distributed_optimizer: true
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: ./Qwen2.5-32B-Instruct
  global_batch_size: 128
  seq_length: 2048
  save_interval: 200
  train_iters: 20000
  stage: ray_ppo
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  distributed_backend: nccl
  no_shared_storage: true
  no_pad_to_seq_lengths: true
  dataset_additional_keys: ['labels']
  data_path: ./data
  split: 100,0,0
  no_shuffle: false
  full_shuffle_instruction_dataset: false
  seed: 1

actor_config:
  model: qwen25_32b
  micro_batch_size: 1
  tensor_model_parallel_size: 8
  pipeline_model_parallel_size: 1
  lr: 1e-6
  lr_decay_style: constant
  min_lr: 0
  weight_decay: 0.01
  lr_warmup_fraction: 0.0
  clip_grad: 1.0
  adam_beta1: 0.9
  adam_beta2: 0.95
  finetune: true
  load: ./ckpt
  save: ./ckpt
  no_load_optim: true
  no_load_rng: true

critic_config:
  model: qwen25_32b
  tensor_model_parallel_size: 8
  pipeline_model_parallel_size: 1
  micro_batch_size: 1
  lr: 5e-6
  lr_decay_style: constant
  min_lr: 0
  weight_decay: 0.01
  lr_warmup_fraction: 0.0
  clip_grad: 1.0
  adam_beta1: 0.9
  adam_beta2: 0.95
  finetune: true
  no_load_optim: True
  no_load_rng: True
  load: ./ckpt
  save: ./ckpt

rl_config:
  guarantee_order: true
  use_integrated_worker: true
  blocking: true
  actor_forward_micro_batch_size: 1
  ref_forward_micro_batch_size: 1
  gamma: 1.0
  lam: 1.0
  adv_estimator: gae
  kl_penalty: kl
  kl_ctrl_type: fixed
  init_kl_coef: 0.0
  use_kl_in_reward: False
  mini_batch_size: 128
  max_prompt_length: 2048
  epochs: 1
  clip_ratio: 0.2
  cliprange_value: 0.5
  entropy_coeff: 0
  shuffle_mini_batch: false
  n_samples_per_prompt: 8
  rule_reward: true
  verifier_function: ["acc_for_ppo"]
  verifier_weight: [1.0]
  num_cpus_for_local_task: 1.0
  use_tensorboard: false
  actor_resource:
    num_npus: 32
  critic_resource:
    num_npus: 32

generate_config:
  enforce_eager: True
  trust_remote_code: true
  offload_train_optimizer: true
  offload_train_grad: true
  offload_train_param: true

  # 推理时的并行配置
  infer_tensor_parallel_size: 8
  infer_pipeline_parallel_size: 1
  infer_expert_parallel_size: 1

  # vllm 模型相关设置
  max_num_seqs: 1024
  max_model_len: 4096
  max_num_batched_tokens: 8192
  dtype: "bfloat16"
  gpu_memory_utilization: 0.4

  # 采样配置
  sampling_config:
    seed: 1
    logprobs: 1
    max_tokens: 2048
    top_p: 1
    top_k: -1
    min_p: 0.0
    temperature: 1.0
    detokenize: false"""


def _upstream(repo_root: Path, tmp_path: Path, text: str = UPSTREAM_PPO_YAML) -> Path:
    return write_upstream(repo_root, tmp_path, "ppo_qwen25_32b_A3.yaml", text)


def test_upstream_ppo_config_passes_and_means_ppo_with_a_critic(repo_root: Path, tmp_path: Path):
    cfg = load_config(_upstream(repo_root, tmp_path))
    d, rl, critic = cfg.derived, cfg.rl_config, cfg.critic_config
    assert d.algorithm == "ppo" and d.critic_trainer and critic is not None
    # critic_config over megatron_training: its own lr and layout, the shared model and batch keys.
    assert (critic.lr, critic.tensor_model_parallel_size, critic.micro_batch_size) == (5e-6, 8, 1)
    assert (critic.load, critic.num_layers, critic.global_batch_size, critic.bf16) == ("./ckpt", 64, 128, True)
    assert (cfg.actor_config.lr, rl.adv_estimator, rl.gamma, rl.lam, rl.cliprange_value) == (1e-6, "gae", 1.0, 1.0, 0.5)
    # No KL: PPO's actor loss has none, and use_kl_in_reward is false, so no reference either.
    assert not d.use_kl_loss and not d.use_kl_in_reward and not d.use_reference and not d.reference_trainer
    assert (d.critic_world_size, d.critic_data_parallel_size, d.critic_params_dtype) == (32, 4, "bfloat16")
    assert d.world_size == 64  # the actor's 32 (rollout and actor share them) and the critic's own 32
    # 128 prompts x 8 samples, mini-batch 128 prompts, one epoch, no KL in the reward: the old-log-prob pass is skipped.
    assert d.skip_old_log_probs


def test_kl_in_the_reward_needs_the_reference_and_the_old_log_probs(repo_root: Path, tmp_path: Path):
    text = UPSTREAM_PPO_YAML.replace("use_kl_in_reward: False", "use_kl_in_reward: True").replace(
        "init_kl_coef: 0.0", "init_kl_coef: 0.05")
    cfg = load_config(_upstream(repo_root, tmp_path, text))
    d = cfg.derived
    assert d.use_reference and d.reference_trainer and d.use_kl_in_reward and not d.use_kl_loss and not d.skip_old_log_probs


@pytest.mark.parametrize(("change", "key", "words"), [
    (("  critic_resource:\n    num_npus: 32\n", ""), None, None),  # unset: the actor's count
    (("adv_estimator: gae", "adv_estimator: group_norm"), "rl_config.adv_estimator", "PPO uses adv_estimator: gae"),
    (("  cliprange_value: 0.5", "  cliprange_value: 0.0"), "rl_config.cliprange_value", "must be > 0"),
    (("  lam: 1.0", "  lam: 1.5"), "rl_config.lam", "must lie in [0, 1]"),
    (("  lr: 5e-6\n", ""), "critic_config.lr", "the critic trains and needs it"),
])
def test_ppo_rules_name_the_key(repo_root: Path, tmp_path: Path, change, key, words):
    old, new = change
    assert old in UPSTREAM_PPO_YAML
    path = _upstream(repo_root, tmp_path, UPSTREAM_PPO_YAML.replace(old, new, 1))
    if key is None:
        assert load_config(path).derived.critic_world_size == 32
        return
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert key in str(exc.value) and words in str(exc.value)


def test_a_critic_outside_ppo_and_gae_without_a_critic_are_refused(repo_root: Path, tmp_path: Path):
    grpo = UPSTREAM_PPO_YAML.replace("stage: ray_ppo", "stage: ray_grpo")
    with pytest.raises(ConfigError, match="only PPO \\(stage: ray_ppo\\) trains a critic"):
        load_config(_upstream(repo_root, tmp_path, grpo))
    with pytest.raises(ConfigError, match="`gae` needs a critic"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=["rl_config.adv_estimator=gae"])
    with pytest.raises(ConfigError, match="has no `critic_config`"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
            "megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae"])
    with pytest.raises(ConfigError, match="use_kl_in_reward is true but stage is not ray_ppo"):
        load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=["rl_config.use_kl_in_reward=true"])


@pytest.mark.parametrize(("override", "what"), [
    ("rlfabric.max_staleness=1", "pipelined mode"),
    ("rl_config.multi_turn_enable=true", "multi-turn rollouts"),
])
def test_what_the_ppo_path_does_not_run_yet_is_refused_by_name(repo_root: Path, tmp_path: Path, override, what):
    with pytest.raises(ConfigError, match=f"asks for {what} with PPO's critic"):
        load_config(_upstream(repo_root, tmp_path), overrides=[override])
