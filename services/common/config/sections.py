"""The non-Megatron sections of a MindSpeed-RL YAML: `rl_config`, `generate_config`, profiling.

One dataclass per section (nested ones for `actor_resource`, `integrated_mode_config` and
`sampling_config`); field names are the YAML keys and each default is written once, here.
Defaults follow MindSpeed-RL's config classes; where MindSpeed-RL keeps a placeholder
(`tokenizer_name_or_path: /path/to/tokenizer`) rlfabric uses None and resolves it (see derived.py).
`rl_config.mini_batch_size` stays in prompts, as written; its size in samples is a derived value.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config.schema import setting

KL_PENALTIES = ("low_var_kl", "kl", "abs", "mse")
KL_CTRL_TYPES = ("fixed", "adaptive")
ADV_ESTIMATORS = ("group_norm",)


@dataclass(kw_only=True)
class ResourceConfig:
    """Devices given to one role."""

    num_npus: int | None = setting(None, "Number of devices (NPUs/GPUs; processes on CPU) for this role.")


@dataclass(kw_only=True)
class IntegratedModeConfig:
    """Options of integrated mode (actor, reference and rollout share devices)."""

    ref_model_load_path: str | None = setting(
        None, "Reference weights to load when resuming (required with finetune: false).")


@dataclass(kw_only=True)
class RLConfig:
    """GRPO/DAPO algorithm, reward, dispatch and placement options (`rl_config`)."""

    # Samples and batches.
    n_samples_per_prompt: int = setting(1, "Samples generated per prompt (the GRPO group size n).")
    mini_batch_size: int = setting(1, "Prompts per optimizer step; each step updates on mini_batch_size * n samples.")
    epochs: int = setting(1, "Passes of optimizer steps over each iteration's samples.")
    shuffle_mini_batch: bool = setting(False, "Shuffle samples before splitting into mini-batches.")
    max_prompt_length: int = setting(512, "Prompts with this many tokens or more are dropped at load time.")
    num_samples_per_step: int = setting(1, "Legacy sample count per step (unused by rlfabric).")
    actor_forward_micro_batch_size: int | None = setting(
        None, "Rows per forward pass when the actor computes old log-probs; unset means micro_batch_size.")
    ref_forward_micro_batch_size: int | None = setting(
        None, "Rows per forward pass when the reference computes log-probs; unset means micro_batch_size.")
    vit_forward_micro_batch_size: int | None = setting(None, "Vision encoder micro-batch (unsupported).")

    # Advantages, loss and KL.
    adv_estimator: str = setting("group_norm", f"Advantage estimator; rlfabric supports {', '.join(ADV_ESTIMATORS)}.")
    gamma: float = setting(1.0, "Discount factor (GAE only).")
    lam: float = setting(0.95, "GAE lambda (GAE only).")
    advantage_whiten: bool = setting(True, "Whiten advantages (GAE only).")
    clip_ratio: float = setting(0.2, "PPO clip range epsilon: ratio is clipped to [1 - eps, 1 + eps].")
    cliprange_value: float = setting(0.5, "Value clip range (PPO critic only).")
    entropy_coeff: float = setting(0.0, "Entropy bonus coefficient (entropy is only computed when non-zero).")
    kl_penalty: str = setting("low_var_kl", f"KL estimator: {', '.join(KL_PENALTIES)}.")
    kl_ctrl_type: str = setting("fixed", f"KL coefficient controller: {', '.join(KL_CTRL_TYPES)}.")
    init_kl_coef: float = setting(0.01, "KL loss coefficient (initial value for the adaptive controller).")
    kl_horizon: int = setting(1000, "Adaptive KL controller horizon.")
    kl_target: float = setting(100.0, "Adaptive KL controller target.")
    use_kl_in_reward: bool = setting(False, "Apply the KL penalty in the reward instead of the loss.")
    token_level_loss: bool = setting(True, "Token-mean over the micro-batch (true) or sequence-mean-token-mean (false).")
    clip_higher_enable: bool = setting(False, "DAPO clip-higher: clip to [1 - clip_ratio_low, 1 + clip_ratio_high].")
    clip_ratio_low: float = setting(0.1, "DAPO clip-higher lower epsilon.")
    clip_ratio_high: float = setting(0.1, "DAPO clip-higher upper epsilon.")

    # Rewards.
    rule_reward: bool = setting(True, "Score with rule verifiers (rlfabric supports rule rewards only).")
    beta: float = setting(0.1, "Weight between rule and model rewards (model rewards unsupported).")
    verifier_function: list[str] = setting(help="Rule verifiers whose weighted scores sum to the reward.",
                                           factory=lambda: ["base_acc"])
    verifier_weight: list[float] = setting(help="Weight of each verifier (same length as verifier_function).",
                                           factory=lambda: [1.0])
    verifier_parallel: int = setting(1, "Verifier processes per reward worker.")
    verifier_timeout: int = setting(30, "Seconds before a verification counts as failed (score 0).")
    overlong_buffer_enable: bool = setting(False, "DAPO overlong reward shaping.")
    overlong_buffer: int = setting(0, "DAPO: tokens before rollout_max_tokens where the length penalty starts.")
    overlong_buffer_penalty_factor: float = setting(1.0, "DAPO: penalty at rollout_max_tokens.")
    rollout_max_tokens: int = setting(2048, "DAPO: response length limit the overlong penalty refers to.")
    filter_groups_enable: bool = setting(False, "DAPO dynamic sampling: keep groups whose metric varies.")
    filter_groups_metric: str = setting("acc", "DAPO: verifier whose scores must vary within a group.")
    filter_groups_max_batches: int = setting(1, "DAPO: most generation batches per iteration (-1: no limit).")
    filter_groups_train_batch_size: int = setting(1, "DAPO: prompts to collect before training.")

    # Placement and workers.
    actor_resource: ResourceConfig = setting(help="Devices of the actor (and of rollout in integrated mode).",
                                             factory=ResourceConfig)
    reference_resource: ResourceConfig | None = setting(None, "Devices of the reference; unset means actor_resource.")
    reward_resource: ResourceConfig | None = setting(None, "Devices of a reward model (unsupported).")
    critic_resource: ResourceConfig | None = setting(None, "Devices of a critic (unsupported).")
    vit_resource: ResourceConfig | None = setting(None, "Devices of a vision encoder (unsupported).")
    use_integrated_worker: bool = setting(True, "Actor, reference and rollout share devices (integrated mode).")
    integrated_mode_config: IntegratedModeConfig | None = setting(None, "Integrated mode options.")
    blocking: bool = setting(True, "Wait for each phase to finish before the next starts.")
    async_engine: bool = setting(False, "Asynchronous generation engine.")
    guarantee_order: bool = setting(False, "Hand samples on in prompt order rather than as they finish.")
    partial_rollout_max_split: int = setting(1, "Partial rollout: split max_tokens over this many iterations.")
    require_max_age_all_finished: bool = setting(True, "Partial rollout: samples at max age must finish.")
    num_cpus_for_local_task: float = setting(1.0, "CPUs per local reward task.")
    num_cpus_for_placement_group: int = setting(8, "CPUs per worker placement group.")
    runtime_env_path: str = setting("configs/envs/runtime_env.yaml", "Ray runtime environment (unused by rlfabric).")
    hccl_buffersize: int = setting(256, "HCCL buffer size in MB (Ascend).")
    tp_split_expert: bool = setting(False, "Split experts over TP ranks.")
    enable_sharding_validate: bool = setting(False, "Validate resharded weights.")
    zmq_communication: bool = setting(True, "Dispatch data over ZeroMQ (MindSpeed-RL transport).")
    data_strategy: str = setting("td", "MindSpeed-RL data strategy (transfer dock).")
    transfer_queue_data_shard_num: int = setting(1, "MindSpeed-RL transfer queue shards.")
    transfer_queue_data_shard_port_base: int | None = setting(None, "MindSpeed-RL transfer queue base port.")
    use_dp_batch_balance: bool = setting(False, "Balance tokens across data-parallel ranks.")
    use_remove_padding: bool = setting(False, "Pack sequences without padding for forward passes.")
    use_dynamic_bsz: bool = setting(False, "Dynamic batch size by token count.")
    max_packing_token_size: int = setting(4096, "Dynamic batch size: tokens per pack.")
    ref_max_packing_token_size: int | None = setting(None, "Reference tokens per pack; unset means max_packing_token_size.")
    actor_max_packing_token_size: int | None = setting(None, "Actor tokens per pack; unset means max_packing_token_size.")
    update_max_packing_token_size: int | None = setting(None, "Update tokens per pack; unset means max_packing_token_size.")
    dynamic_max_batch_size: int | None = setting(None, "Dynamic batch size: most rows per pack.")
    ref_dynamic_max_batch_size: int | None = setting(None, "Reference rows per pack.")
    actor_dynamic_max_batch_size: int | None = setting(None, "Actor rows per pack.")
    update_dynamic_max_batch_size: int | None = setting(None, "Update rows per pack.")
    update_micro_batch_size: int | None = setting(None, "Legacy update micro-batch (unused by rlfabric).")
    is_multimodal: bool = setting(False, "Multimodal model (unsupported).")
    reuse_image_embeds: bool = setting(False, "Reuse image embeddings (unsupported).")
    colocate_actor_and_vit: bool = setting(False, "Colocate actor and vision encoder (unsupported).")
    share_backbone: bool = setting(False, "LoRA: share the backbone between actor and reference.")
    multi_turn_enable: bool = setting(False, "Multi-turn tool use (unsupported).")
    tool_config_path: str | None = setting(None, "Multi-turn tool configuration (unsupported).")
    max_tool_calls: int = setting(0, "Multi-turn: most tool calls.")
    max_parallel_calls: int = setting(0, "Multi-turn: most parallel tool calls.")
    max_total_response_length: int = setting(0, "Multi-turn: most response tokens overall.")
    max_tool_response_length: int = setting(0, "Multi-turn: most tokens per tool response.")
    tool_response_truncate_side: str | None = setting(None, "Multi-turn: which side to truncate.")
    tool_parser_format: str | None = setting(None, "Multi-turn: tool call format.")

    # Dispatch sizes: samples handed to one data-parallel rank per call; unset means derived.
    actor_rollout_dispatch_size: int | None = setting(None, "Samples per rollout call; unset: gbs * n / rollout DP.")
    actor_logprob_dispatch_size: int | None = setting(None, "Samples per old-log-prob call; unset: gbs * n / actor DP.")
    ref_dispatch_size: int | None = setting(None, "Samples per reference call; unset: gbs * n / reference DP.")
    reward_dispatch_size: int | None = setting(None, "Samples per reward call; unset: gbs * n.")
    adv_dispatch_size: int | None = setting(None, "Samples per advantage computation; unset: gbs * n.")
    actor_update_dispatch_size: int | None = setting(None, "Samples per update call; unset: gbs * n / actor DP.")
    dynamic_sampling_dispatch_size: int | None = setting(None, "DAPO: samples per dynamic sampling call.")
    critic_update_dispatch_size: int | None = setting(None, "Critic update dispatch (unsupported).")
    critic_value_dispatch_size: int | None = setting(None, "Critic value dispatch (unsupported).")
    kl_dispatch_size: int | None = setting(None, "KL-in-reward dispatch (unsupported).")
    actor_image_embeds_dispatch_size: int | None = setting(None, "Image embedding dispatch (unsupported).")

    # Logging.
    use_tensorboard: bool = setting(False, "Write metrics to TensorBoard (train/{key}).")
    use_wandb: bool = setting(False, "Write metrics to Weights & Biases.")
    wandb_project: str = setting("", "Weights & Biases project (required with use_wandb).")
    wandb_exp_name: str = setting("", "Weights & Biases run name (required with use_wandb).")
    wandb_save_dir: str = setting("", "Weights & Biases local directory.")
    use_swanlab: bool = setting(False, "Write metrics to SwanLab (unsupported).")
    swanlab_mode: str = setting("", "SwanLab mode.")
    swanlab_project: str = setting("", "SwanLab project.")
    swanlab_exp_name: str = setting("", "SwanLab run name.")
    swanlab_save_dir: str = setting("", "SwanLab local directory.")
    log_max_throughput: bool = setting(True, "Compute throughput from maximum (padded) lengths.")


@dataclass(kw_only=True)
class SamplingConfig:
    """vLLM sampling parameters (`generate_config.sampling_config`)."""

    logprobs: int = setting(1, "Top log-probs returned per generated token.")
    max_tokens: int = setting(128, "Most tokens generated per response.")
    top_p: float = setting(1.0, "Nucleus sampling threshold.")
    top_k: int = setting(50, "Top-k sampling (-1: disabled).")
    min_p: float = setting(0.0, "Minimum probability relative to the most likely token.")
    temperature: float = setting(0.2, "Sampling temperature; training log-probs divide logits by it too.")
    detokenize: bool = setting(False, "Return response text as well as token ids.")
    seed: int | None = setting(
        None, "Run sampling seed; each sample draws its own stream from (seed, iteration, prompt, index). Unset: a "
              "seed drawn once per run and journaled, so a resumed run redraws the same samples.")


@dataclass(kw_only=True)
class GenerateConfig:
    """Rollout engine options (`generate_config`)."""

    tokenizer_name_or_path: str | None = setting(None, "Rollout tokenizer; unset means megatron_training's.")
    trust_remote_code: bool = setting(True, "Allow custom model/tokenizer code.")
    data_parallel_size: int | None = setting(None, "Rollout DP; computed as devices / (infer TP * infer PP).")
    infer_tensor_parallel_size: int = setting(8, "Tensor parallel size of each rollout engine.")
    infer_pipeline_parallel_size: int = setting(1, "Pipeline parallel size of rollout (must be 1).")
    infer_expert_parallel_size: int = setting(1, "Expert parallel size of rollout.")
    max_num_seqs: int = setting(1, "Most sequences an engine runs at once.")
    max_model_len: int = setting(2048, "Longest prompt + response an engine accepts.")
    max_num_batched_tokens: int = setting(2048, "Most tokens an engine processes per step.")
    dtype: str = setting("bfloat16", "Rollout weight dtype: bfloat16, float16, float32 or auto.")
    gpu_memory_utilization: float = setting(0.5, "Fraction of device memory the engine may use.")
    offload_train_optimizer: bool = setting(False, "Integrated mode: offload optimizer state during rollout.")
    offload_train_grad: bool = setting(False, "Integrated mode: offload gradients during rollout.")
    offload_train_param: bool = setting(False, "Integrated mode: offload training weights during rollout.")
    enable_prefix_caching: bool = setting(False, "Reuse KV cache across prompts sharing a prefix.")
    num_scheduler_steps: int = setting(1, "Scheduler steps per engine step (legacy vLLM).")
    enforce_eager: bool = setting(True, "Run without graph capture.")
    sampling_config: SamplingConfig = setting(help="Sampling parameters.", factory=SamplingConfig)


@dataclass(kw_only=True)
class ProfilerConfig:
    """Profiler options for one role (`profiler_config.<role>`, e.g. `integrated`)."""

    profile: bool = setting(False, "Enable the profiler.")
    mstx: bool = setting(False, "Lightweight (mstx) collection.")
    stage: str = setting("all", "Phase to profile: all, actor_generate, actor_compute_log_prob, ...")
    profile_save_path: str = setting("", "Directory for profiles.")
    profile_export_type: str = setting("text", "Export format: text or db.")
    profile_level: str = setting("level0", "Detail level: level0, level1, level2, level_none.")
    profile_with_memory: bool = setting(False, "Record memory usage.")
    profile_record_shapes: bool = setting(False, "Record tensor shapes.")
    profile_with_cpu: bool = setting(True, "Record host activity.")
    profile_with_npu: bool = setting(True, "Record device activity.")
    profile_with_module: bool = setting(False, "Record Python call stacks.")
    profile_step_start: int = setting(1, "First iteration profiled.")
    profile_step_end: int = setting(2, "Iteration at which profiling stops.")
    profile_analysis: bool = setting(False, "Analyse profiles online.")
    profile_ranks: str | list[int] = setting("all", "Ranks to profile: all or a list.")


@dataclass(kw_only=True)
class FabricConfig:
    """rlfabric's own keys (`rlfabric:`), for what MindSpeed-RL, one Ray program, has no setting: the services
    talk over a network. Optional; upstream YAMLs have no such section and load unchanged."""

    rpc_deadline_s: float = setting(
        600.0, "Longest one coordinator call to a service (a Generate stream, an Update, a weight push) may take, "
               "in seconds; a call past it fails the iteration naming the service.")


@dataclass(kw_only=True)
class MsprobeConfig:
    """MindStudio msprobe data-dump options (`msprobe_config`; accepted, ignored by rlfabric)."""

    msprobe: bool = setting(False, "Enable msprobe dumps.")
    dump_path: str = setting("./msprobe_dump", "Dump directory.")
    key_data_dump: bool = setting(False, "Dump key data.")
    configurations_dump: bool = setting(False, "Dump configurations.")
    actor_train_dump: bool = setting(False, "Dump actor training data.")
    actor_infer_dump: bool = setting(False, "Dump actor inference data.")
    token_range_start: int = setting(0, "First token dumped.")
    token_range_end: int = setting(0, "Last token dumped.")
    reference_dump: bool = setting(False, "Dump reference data.")
    critic_train_dump: bool = setting(False, "Dump critic data.")
    step_start: int = setting(0, "First iteration dumped.")
    step_end: int = setting(0, "Last iteration dumped.")
