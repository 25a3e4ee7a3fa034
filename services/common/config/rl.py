"""`rl_config`: the GRPO/DAPO algorithm, rewards, placement and logging (`RLConfig`), with the nested
`actor_resource` / `reference_resource` (`ResourceConfig`) and `integrated_mode_config`.

Defaults follow MindSpeed-RL's `RLConfig`; `mini_batch_size` stays in prompts, as written (its size in
samples is a derived value). Which keys the selected algorithm (`megatron_training.stage`) reads is
decided in algorithm.py; each key's status sits beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config.schema import inert, read, refused, setting
from services.common.config.statuses import (
    ALGORITHM_VARIANTS,
    COORDINATOR_APP,
    COORDINATOR_RUN,
    COORDINATOR_SETTINGS,
    DERIVED,
    DISPATCH,
    ITERATION,
    LORA_RULES,
    MULTI_TURN_RULES,
    MULTIMODAL,
    PARTIAL_ROLLOUT_RULES,
    PPO_RULES,
    RAY,
    REWARD_MODEL,
    TRAINER_OPTIONS,
    UPSTREAM_UNUSED,
    VALIDATION,
)

KL_PENALTIES = ("low_var_kl", "kl", "abs", "mse")
KL_CTRL_TYPES = ("fixed", "adaptive")
# MindSpeed-RL's group_norm, then verl's outcome-reward estimators (services/common/config/loss_variants.py).
ADV_ESTIMATORS = ("group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# PPO's (stage: ray_ppo), over a critic's values: the one estimator of per-token advantages (services/common/config/ppo.py).
CRITIC_ADV_ESTIMATORS = ("gae",)
# MindSpeed-RL's default verifier list (RLConfig.verifier_function): the one default of the run's verifiers.
DEFAULT_VERIFIER_FUNCTION = ("base_acc",)
DEFAULT_VERIFIER_WEIGHT = (1.0,)

_GAE = read(PPO_RULES, COORDINATOR_SETTINGS, note="PPO (stage: ray_ppo) only: GAE over the critic's values "
                                                     "(services/coordinator/gae.py); no other estimator reads it")
_MULTI_TURN = read(MULTI_TURN_RULES, COORDINATOR_SETTINGS, note="with multi_turn_enable (services/coordinator/multi_turn.py)")
_MULTIMODAL = refused("rlfabric trains text-only models", feature=MULTIMODAL)
_DYNAMIC_BSZ = read(TRAINER_OPTIONS, note="used with use_dynamic_bsz (services/trainer/packing.py)")
# Upstream copies these defaults into the per-pass keys before it reads the YAML, so set here they reach no actor or
# reference pass; its PPO critic alone reads them (critic_worker.py), and so does rlfabric's.
_CRITIC_BUDGET = read(TRAINER_OPTIONS, note="PPO's critic's budget under use_dynamic_bsz, as MindSpeed-RL's critic "
                                            "worker reads it; the actor's and reference's passes read their per-pass "
                                            "keys only (upstream copies this default into them before it reads the YAML)")
_DYNAMIC_SAMPLING = read(COORDINATOR_SETTINGS, ITERATION)


@dataclass(kw_only=True)
class ResourceConfig:
    """Devices given to one role."""

    num_npus: int | None = setting(None, "Number of devices (NPUs/GPUs; processes on CPU) for this role.",
                                   read(DERIVED))


@dataclass(kw_only=True)
class IntegratedModeConfig:
    """Options of integrated mode (actor, reference and rollout share devices)."""

    ref_model_load_path: str | None = setting(
        None, "Reference weights to load (required to resume a trained checkpoint with finetune: false).",
        read(DERIVED))


@dataclass(kw_only=True)
class RLConfig:
    """GRPO/DAPO algorithm, reward, dispatch and placement options (`rl_config`)."""

    # Samples and batches.
    n_samples_per_prompt: int = setting(1, "Samples generated per prompt (the GRPO group size n).",
                                        read(COORDINATOR_SETTINGS, TRAINER_OPTIONS, DERIVED))
    mini_batch_size: int = setting(1, "Prompts per optimizer step; each step updates on mini_batch_size * n samples.",
                                   read(TRAINER_OPTIONS, DERIVED))
    epochs: int = setting(1, "Passes of optimizer steps over each iteration's samples.", read(TRAINER_OPTIONS, DERIVED))
    shuffle_mini_batch: bool = setting(False, "Shuffle samples before splitting into mini-batches.",
                                       read(TRAINER_OPTIONS))
    max_prompt_length: int = setting(512, "Prompts with this many tokens or more are dropped at load time.",
                                     read(COORDINATOR_APP, DERIVED))
    num_samples_per_step: int = setting(1, "Legacy sample count per step (unused by rlfabric).", UPSTREAM_UNUSED)
    actor_forward_micro_batch_size: int | None = setting(
        None, "Rows per forward pass when the actor computes old log-probs; unset means micro_batch_size.",
        read(COORDINATOR_SETTINGS, DERIVED))
    ref_forward_micro_batch_size: int | None = setting(
        None, "Rows per forward pass when the reference computes log-probs; unset means micro_batch_size.",
        read(COORDINATOR_SETTINGS, DERIVED))
    vit_forward_micro_batch_size: int | None = setting(None, "Vision encoder micro-batch (unsupported).", _MULTIMODAL)

    # Advantages, loss and KL.
    adv_estimator: str = setting(
        "group_norm", f"Advantage estimator; rlfabric supports {', '.join(ADV_ESTIMATORS + CRITIC_ADV_ESTIMATORS)}.",
        read(VALIDATION, COORDINATOR_SETTINGS, ALGORITHM_VARIANTS,
             note="group_norm is MindSpeed-RL's (GRPO and DAPO), gae its PPO's (with a critic); rloo and "
                  "reinforce_plus_plus(_baseline) are verl's"))
    gamma: float = setting(1.0, "Discount factor (GAE; with reinforce_plus_plus only 1.0).", read(
        ALGORITHM_VARIANTS, PPO_RULES, COORDINATOR_SETTINGS,
        note="GAE's discount (PPO); with the reinforce_plus_plus estimators it must be 1.0 (one advantage per "
             "sample), otherwise unused"))
    lam: float = setting(0.95, "GAE lambda (GAE only).", _GAE)
    advantage_whiten: bool = setting(True, "Whiten advantages (GAE only).", inert(
        "declared by MindSpeed-RL and never read there: its GAE always whitens the advantages, as rlfabric's does "
        "(services/coordinator/gae.py)"))
    clip_ratio: float = setting(0.2, "PPO clip range epsilon: ratio is clipped to [1 - eps, 1 + eps].",
                                read(TRAINER_OPTIONS))
    cliprange_value: float = setting(0.5, "Value clip range (PPO critic only).", read(
        PPO_RULES, TRAINER_OPTIONS, note="the critic's clipped value loss (services/trainer/value_loss.py)"))
    entropy_coeff: float = setting(0.0, "Entropy bonus coefficient (entropy is only computed when non-zero).",
                                   read(TRAINER_OPTIONS))
    kl_penalty: str = setting("low_var_kl", f"KL estimator: {', '.join(KL_PENALTIES)}.", read(TRAINER_OPTIONS))
    kl_ctrl_type: str = setting("fixed", f"KL coefficient controller: {', '.join(KL_CTRL_TYPES)}.", read(COORDINATOR_SETTINGS))
    init_kl_coef: float = setting(0.01, "KL loss coefficient (initial value for the adaptive controller).",
                                  read(COORDINATOR_SETTINGS, DERIVED))
    kl_horizon: int = setting(1000, "Adaptive KL controller horizon.", read(COORDINATOR_SETTINGS))
    kl_target: float = setting(100.0, "Adaptive KL controller target.", read(COORDINATOR_SETTINGS))
    use_kl_in_reward: bool = setting(False, "Apply the KL penalty in the reward instead of the loss (PPO only).",
                                     read(PPO_RULES, DERIVED, COORDINATOR_SETTINGS,
                                          note="PPO: reward_t = score_t - kl_coef * kl_t before GAE "
                                               "(services/coordinator/gae.py); refused under GRPO/DAPO, which never "
                                               "read it upstream"))
    token_level_loss: bool = setting(True, "Token-mean over the micro-batch (true) or sequence-mean-token-mean (false).",
                                     read(TRAINER_OPTIONS, note="read by DAPO; GRPO's loss is always token-level"))
    clip_higher_enable: bool = setting(False, "DAPO clip-higher: clip to [1 - clip_ratio_low, 1 + clip_ratio_high].",
                                       read(TRAINER_OPTIONS, note="DAPO only (refused under ray_grpo)"))
    clip_ratio_low: float = setting(0.1, "DAPO clip-higher lower epsilon.", read(TRAINER_OPTIONS))
    clip_ratio_high: float = setting(0.1, "DAPO clip-higher upper epsilon.", read(TRAINER_OPTIONS))

    # Rewards.
    rule_reward: bool = setting(True, "Score with rule verifiers (rlfabric supports rule rewards only).",
                                refused("rlfabric scores with the rule verifiers of verifier_function", feature=REWARD_MODEL))
    beta: float = setting(0.1, "Weight between rule and model rewards (model rewards unsupported).",
                          inert("weights rule against model rewards; rlfabric has rule rewards only"))
    verifier_function: list[str] = setting(help="Rule verifiers whose weighted scores sum to the reward.",
                                           factory=lambda: list(DEFAULT_VERIFIER_FUNCTION), status=read(COORDINATOR_SETTINGS))
    verifier_weight: list[float] = setting(help="Weight of each verifier (same length as verifier_function).",
                                           factory=lambda: list(DEFAULT_VERIFIER_WEIGHT), status=read(COORDINATOR_SETTINGS))
    verifier_parallel: int = setting(1, "Verifier processes per reward worker.", inert(
        "a reward worker's verifier processes are its `--processes` flag (rlfabric reward serve)"))
    verifier_timeout: int = setting(30, "Seconds before a verification counts as failed (score 0).", inert(
        "a reward worker's per-sample deadline is its `--deadline-s` flag (rlfabric reward serve)"))
    overlong_buffer_enable: bool = setting(False, "DAPO overlong reward shaping.", read(COORDINATOR_SETTINGS))
    overlong_buffer: int = setting(0, "DAPO: tokens before rollout_max_tokens where the length penalty starts.",
                                   read(COORDINATOR_SETTINGS))
    overlong_buffer_penalty_factor: float = setting(1.0, "DAPO: penalty at rollout_max_tokens.", read(COORDINATOR_SETTINGS))
    rollout_max_tokens: int = setting(2048, "DAPO: response length limit the overlong penalty refers to.",
                                      read(COORDINATOR_SETTINGS))
    filter_groups_enable: bool = setting(False, "DAPO dynamic sampling: keep groups whose metric varies.",
                                         _DYNAMIC_SAMPLING)
    filter_groups_metric: str = setting("acc", "DAPO: verifier whose scores must vary within a group.",
                                        _DYNAMIC_SAMPLING)
    filter_groups_max_batches: int = setting(1, "DAPO: most generation batches per iteration (-1: no limit).",
                                             _DYNAMIC_SAMPLING)
    filter_groups_train_batch_size: int = setting(1, "DAPO: prompts to collect before training.", _DYNAMIC_SAMPLING)

    # Placement and workers.
    actor_resource: ResourceConfig = setting(help="Devices of the actor (and of rollout in integrated mode).",
                                             factory=ResourceConfig, status=read(DERIVED))
    reference_resource: ResourceConfig | None = setting(None, "Devices of the reference; unset means actor_resource.",
                                                        read(DERIVED))
    reward_resource: ResourceConfig | None = setting(None, "Devices of a reward model (unsupported).",
                                                     refused("no reward model runs", feature=REWARD_MODEL))
    critic_resource: ResourceConfig | None = setting(None, "Devices of PPO's critic; unset means actor_resource.",
                                                     read(DERIVED))
    vit_resource: ResourceConfig | None = setting(None, "Devices of a vision encoder (unsupported).", _MULTIMODAL)
    use_integrated_worker: bool = setting(True, "Actor, reference and rollout share devices (integrated mode).",
                                          read(COORDINATOR_SETTINGS, COORDINATOR_RUN, DERIVED))
    integrated_mode_config: IntegratedModeConfig | None = setting(None, "Integrated mode options.", read(DERIVED))
    blocking: bool = setting(True, "Wait for each phase to finish before the next starts.", inert(
        "Ray call scheduling; rlfabric's coordinator overlaps scoring and the reference pass with rollout and "
        "waits for all of them before the update, so the numbers do not depend on it"))
    async_engine: bool = setting(
        False, "Asynchronous generation engine. With partial rollout: each round generates every response to its end "
               "and is interrupted once global_batch_size groups have ended; the interrupted responses continue in a "
               "later iteration.",
        read(COORDINATOR_SETTINGS, note="with partial_rollout_max_split > 1 only (services/coordinator/partial_rollout.py); "
                                        "without it, nothing to change: rlfabric's rollout always streams samples as "
                                        "they finish"))
    guarantee_order: bool = setting(False, "Hand samples on in prompt order rather than as they finish.", inert(
        "rlfabric orders every iteration's samples by prompt and index before training, whatever order they "
        "finish in"))
    partial_rollout_max_split: int = setting(
        1, "Partial rollout: a response is generated in chunks of max_tokens // N over at most N iterations (N > 1); "
           "cut responses continue with newer weights, their tokens tagged with the version that produced them. "
           "1: off.", read(PARTIAL_ROLLOUT_RULES, VALIDATION, COORDINATOR_SETTINGS, TRAINER_OPTIONS,
                           note="N > 1 needs max_tokens divisible by N and no multi-turn, dynamic sampling, critic "
                                "or routing replay; "
                                "the staleness fence and the default token-level truncated IS allow N - 1 more "
                                "versions of lag (services/common/weight_version.py staleness_bound)"))
    require_max_age_all_finished: bool = setting(
        True, "Partial rollout with async_engine: the interrupt waits for the responses at their last split (true), or "
              "cuts them too (false; their groups may then pass the staleness fence and be dropped).",
        read(COORDINATOR_SETTINGS, note="with partial_rollout_max_split > 1 and async_engine only; the synchronous "
                                        "engine runs every chunk to its end, so a response at its last split always "
                                        "ends in its iteration"))
    num_cpus_for_local_task: float = setting(1.0, "CPUs per local reward task.", RAY)
    num_cpus_for_placement_group: int = setting(8, "CPUs per worker placement group.", RAY)
    runtime_env_path: str = setting("configs/envs/runtime_env.yaml", "Ray runtime environment (unused by rlfabric).",
                                    RAY)
    hccl_buffersize: int = setting(256, "HCCL buffer size in MB (Ascend).",
                                   inert("Ascend HCCL buffer; rlfabric has no HCCL on this path"))
    tp_split_expert: bool = setting(False, "Split experts over TP ranks (declared, never read upstream).",
                                    UPSTREAM_UNUSED)
    enable_sharding_validate: bool = setting(False, "Validate resharded weights.", inert(
        "no longer in MindSpeed-RL's RLConfig; rlfabric always checksums every weight bucket it reshards"))
    zmq_communication: bool = setting(True, "Dispatch data over ZeroMQ (MindSpeed-RL transport).", RAY)
    data_strategy: str = setting("td", "MindSpeed-RL data strategy (transfer dock).", RAY)
    transfer_queue_data_shard_num: int = setting(1, "MindSpeed-RL transfer queue shards.", RAY)
    transfer_queue_data_shard_port_base: int | None = setting(None, "MindSpeed-RL transfer queue base port.", RAY)
    use_dp_batch_balance: bool = setting(False, "Balance tokens across data-parallel ranks.", inert(
        "which samples each data-parallel rank gets (speed); rlfabric splits each mini-batch in order, so only "
        "the grouping of the per-micro-batch token mean can differ"))
    use_remove_padding: bool = setting(
        False, "Pack each micro-batch's sequences into one row without padding (old-log-prob, reference and "
        "update passes).", read(TRAINER_OPTIONS, note="THD on accelerators with TransformerEngine, a "
                                "block-diagonal mask on CPU; the same numbers as padded rows"))
    use_dynamic_bsz: bool = setting(
        False, "Form micro-batches by token budget (*_max_packing_token_size, *_dynamic_max_batch_size) "
        "instead of micro_batch_size rows.", read(TRAINER_OPTIONS, note="each micro-batch's token mean is "
                                                 "weighted by its share of the mini-batch's rows, as upstream"))
    max_packing_token_size: int = setting(4096, "Dynamic batch size: the critic's token budget (PPO); default of the "
                                                "per-pass token budgets.", _CRITIC_BUDGET)
    ref_max_packing_token_size: int | None = setting(None, "Reference pass: most tokens (prompt + response) per "
                                                           "micro-batch; unset means 4096.", _DYNAMIC_BSZ)
    actor_max_packing_token_size: int | None = setting(None, "Old-log-prob pass: most tokens per micro-batch; "
                                                             "unset means 4096.", _DYNAMIC_BSZ)
    update_max_packing_token_size: int | None = setting(None, "Update pass: most tokens per micro-batch; unset "
                                                              "means 4096.", _DYNAMIC_BSZ)
    dynamic_max_batch_size: int | None = setting(None, "Dynamic batch size: the critic's row limit (PPO); default of "
                                                       "the per-pass row limits.", _CRITIC_BUDGET)
    ref_dynamic_max_batch_size: int | None = setting(None, "Reference pass: most rows per micro-batch; unset "
                                                           "means no limit.", _DYNAMIC_BSZ)
    actor_dynamic_max_batch_size: int | None = setting(None, "Old-log-prob pass: most rows per micro-batch; "
                                                             "unset means no limit.", _DYNAMIC_BSZ)
    update_dynamic_max_batch_size: int | None = setting(None, "Update pass: most rows per micro-batch; unset "
                                                              "means no limit.", _DYNAMIC_BSZ)
    update_micro_batch_size: int | None = setting(None, "Legacy update micro-batch (unused by rlfabric).",
                                                  inert("no longer in MindSpeed-RL's RLConfig"))
    is_multimodal: bool = setting(False, "Multimodal model (unsupported).", _MULTIMODAL)
    reuse_image_embeds: bool = setting(False, "Reuse image embeddings (unsupported).", _MULTIMODAL)
    colocate_actor_and_vit: bool = setting(False, "Colocate actor and vision encoder (unsupported).", _MULTIMODAL)
    share_backbone: bool = setting(False, "LoRA: share the backbone between actor and reference.", read(
        DERIVED, LORA_RULES,
        note="the reference is the actor's backbone with its LoRA adapters off (ComputeLogProbs adapters_off), no "
             "reference trainer (derived.reference_trainer); needs LoRA"))
    multi_turn_enable: bool = setting(False, "Multi-turn tool use: the model's tool calls are answered by the tool "
                                             "servers between turns.", _MULTI_TURN)
    tool_config_path: str | None = setting(None, "Multi-turn: the tool YAML (MindSpeed-RL's format).", _MULTI_TURN)
    max_tool_calls: int = setting(0, "Multi-turn: most tool calls answered per sample, over all its turns.",
                                  _MULTI_TURN)
    max_parallel_calls: int = setting(0, "Multi-turn: most calls answered per turn, at once.", _MULTI_TURN)
    max_total_response_length: int = setting(0, "Multi-turn: most response tokens per sample (turns and tool "
                                                "answers).", _MULTI_TURN)
    max_tool_response_length: int = setting(0, "Multi-turn: most characters of one tool answer.", _MULTI_TURN)
    tool_response_truncate_side: str | None = setting(None, "Multi-turn: which part of a long answer is kept: "
                                                            "left (the head), right (the tail), middle (both "
                                                            "ends; unset).", _MULTI_TURN)
    tool_parser_format: str | None = setting(None, "Multi-turn: tool-call format (hermes; unset: hermes).",
                                             _MULTI_TURN)

    # Dispatch sizes: samples handed to one data-parallel rank per call; unset means derived.
    actor_rollout_dispatch_size: int | None = setting(None, "Samples per rollout call; unset: gbs * n / rollout DP.",
                                                      DISPATCH)
    actor_logprob_dispatch_size: int | None = setting(None, "Samples per old-log-prob call; unset: gbs * n / actor DP.",
                                                      DISPATCH)
    ref_dispatch_size: int | None = setting(None, "Samples per reference call; unset: gbs * n / reference DP.",
                                            DISPATCH)
    reward_dispatch_size: int | None = setting(None, "Samples per reward call; unset: gbs * n.", DISPATCH)
    adv_dispatch_size: int | None = setting(None, "Samples per advantage computation; unset: gbs * n.", DISPATCH)
    actor_update_dispatch_size: int | None = setting(None, "Samples per update call; unset: gbs * n / actor DP.",
                                                     DISPATCH)
    dynamic_sampling_dispatch_size: int | None = setting(None, "DAPO: samples per dynamic sampling call.", DISPATCH)
    critic_update_dispatch_size: int | None = setting(None, "PPO: samples per critic update call.", DISPATCH)
    critic_value_dispatch_size: int | None = setting(None, "PPO: samples per critic value call.", DISPATCH)
    kl_dispatch_size: int | None = setting(None, "PPO: samples per KL-in-reward call.", DISPATCH)
    actor_image_embeds_dispatch_size: int | None = setting(None, "Image embedding dispatch (unsupported).",
                                                           _MULTIMODAL)

    # Logging.
    use_tensorboard: bool = setting(False, "Write metrics to TensorBoard (train/{key}).", read(COORDINATOR_APP))
    use_wandb: bool = setting(False, "Write metrics to Weights & Biases.", read(COORDINATOR_APP))
    wandb_project: str = setting("", "Weights & Biases project (required with use_wandb).", read(COORDINATOR_APP))
    wandb_exp_name: str = setting("", "Weights & Biases run name (required with use_wandb).", read(COORDINATOR_APP))
    wandb_save_dir: str = setting("", "Weights & Biases local directory.", read(COORDINATOR_APP))
    use_swanlab: bool = setting(False, "Write metrics to SwanLab.", read(COORDINATOR_APP))
    swanlab_mode: str = setting("", "SwanLab mode (cloud, local, offline, disabled; empty: SwanLab's default).",
                                read(COORDINATOR_APP))
    swanlab_project: str = setting("", "SwanLab project (required with use_swanlab).", read(COORDINATOR_APP))
    swanlab_exp_name: str = setting("", "SwanLab run name (required with use_swanlab).", read(COORDINATOR_APP))
    swanlab_save_dir: str = setting("", "SwanLab local directory (empty: swanlab/ in the run's directory).",
                                    read(COORDINATOR_APP))
    log_max_throughput: bool = setting(True, "Compute throughput from maximum (padded) lengths.", read(COORDINATOR_SETTINGS))
