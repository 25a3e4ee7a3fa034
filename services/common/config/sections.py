"""The rollout and tooling sections: `generate_config` (with `sampling_config`), `profiler_config`,
`msprobe_config`, and rlfabric's own `rlfabric:` section.

One dataclass per section; field names are the YAML keys, each default and status is written once,
here. Defaults follow MindSpeed-RL's config classes; where MindSpeed-RL keeps a placeholder
(`tokenizer_name_or_path: /path/to/tokenizer`) rlfabric uses None and resolves it (see derived.py).
The vllm-ascend keys (`torchair_graph`, `ascend_scheduler_config_enabled`, `expert_map_path`) reach the
engine as MindSpeed-RL passes them (`vllm_additional_config`) and only act where vllm-ascend runs;
`enable_expert_parallel` is vLLM's own switch, passed on as upstream passes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.common.config.schema import inert, read, refused, setting
from services.common.config.statuses import (
    ALGORITHM_VARIANTS,
    CONFIG_SECTIONS,
    COORDINATOR_RUN,
    COORDINATOR_SETTINGS,
    COORDINATOR_VALIDATION,
    DERIVED,
    MULTIMODAL,
    ROLLOUT_CLI,
    ROLLOUT_OPTIONS,
    ROUTING_REPLAY,
    TRAINER_OPTIONS,
    VALIDATION,
)

_ENGINE = read(ROLLOUT_OPTIONS)
_SAMPLING = read(ROLLOUT_OPTIONS, COORDINATOR_SETTINGS)
_ASCEND_CONFIG = read(CONFIG_SECTIONS, platform="ascend", note="in vLLM's additional_config as MindSpeed-RL builds "
                                                               "it (vllm_additional_config, passed on by "
                                                               "services/rollout/vllm_args.py); only vllm-ascend acts on it")
_EXPERT_PARALLEL = read(ROLLOUT_OPTIONS, note="passed to vLLM (`enable_expert_parallel`) as MindSpeed-RL passes it: "
                                              "an engine's MoE layers place whole experts on its ranks instead of "
                                              "splitting each expert over them (the same outputs); dense models "
                                              "have no MoE layer to act on")
_NO_PROFILER = refused("MindStudio profiling is not available in rlfabric; use the timing/* metrics and each "
                       "service's Prometheus endpoint")
_PROFILE_ONLY = inert("only read with profile: true (refused)")
_NO_MSPROBE = refused("MindStudio msprobe dumps are not available in rlfabric")
_MSPROBE_ONLY = inert("only read with msprobe: true (refused)")


# The values of rlfabric.weight_transport (validated in validation.py, chosen in coordinator/weight_sync.py).
WEIGHT_TRANSPORTS = ("auto", "grpc", "collective")
# rlfabric.routing_replay: none, or replay the rollout's expert choices in training (MoE; rules in
# config/routing_replay.py).
RoutingReplay = Literal["none", "rollout"]
# The verl keys' values (services/common/config/loss_variants.py holds the tuples and the rules).
PolicyLossMode = Literal["vanilla", "gspo"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RolloutIsLevel = Literal["token", "sequence"]


@dataclass(kw_only=True)
class SamplingConfig:
    """vLLM sampling parameters (`generate_config.sampling_config`)."""

    logprobs: int = setting(1, "Top log-probs returned per generated token.", read(ROLLOUT_OPTIONS))
    max_tokens: int = setting(128, "Most tokens generated per response.", _SAMPLING)
    top_p: float = setting(1.0, "Nucleus sampling threshold.", _SAMPLING)
    top_k: int = setting(50, "Top-k sampling (-1: disabled).", _SAMPLING)
    min_p: float = setting(0.0, "Minimum probability relative to the most likely token.", _SAMPLING)
    temperature: float = setting(0.2, "Sampling temperature; training log-probs divide logits by it too.", _SAMPLING)
    detokenize: bool = setting(False, "Return response text as well as token ids.", inert(
        "responses travel as token ids; the coordinator decodes them for the verifiers itself"))
    seed: int | None = setting(
        None, "Run sampling seed; each sample draws its own stream from (seed, iteration, prompt, index). Unset: a "
              "seed drawn once per run and journaled, so a resumed run redraws the same samples.", _SAMPLING)


@dataclass(kw_only=True)
class GenerateConfig:
    """Rollout engine options (`generate_config`)."""

    tokenizer_name_or_path: str | None = setting(None, "Rollout tokenizer; unset means megatron_training's.",
                                                 read(DERIVED))
    trust_remote_code: bool = setting(False, "Allow custom model/tokenizer code.", _ENGINE)
    data_parallel_size: int | None = setting(None, "Rollout DP; computed as devices / (infer TP * infer PP).",
                                             read(VALIDATION, note="must equal the computed value"))
    infer_tensor_parallel_size: int = setting(8, "Tensor parallel size of each rollout engine.",
                                              read(ROLLOUT_OPTIONS, DERIVED))
    infer_pipeline_parallel_size: int = setting(1, "Pipeline parallel size of rollout (must be 1).",
                                                refused("rollout runs without pipeline parallelism", allowed=(1,)))
    infer_expert_parallel_size: int = setting(1, "Expert parallel size of rollout (vLLM data-parallel engines that "
                                                 "share the experts, with enable_expert_parallel).", inert(
        "how upstream's rollout spreads experts over engines (VLLM_DP_SIZE engines sharing them): the same samples; "
        "rlfabric's rollout engines are independent replicas, each holding every expert (spread over its own "
        "infer_tensor_parallel_size ranks with enable_expert_parallel)"))
    max_num_seqs: int = setting(1, "Most sequences an engine runs at once.", _ENGINE)
    max_model_len: int = setting(2048, "Longest prompt + response an engine accepts.", _ENGINE)
    max_num_batched_tokens: int = setting(2048, "Most tokens an engine processes per step.", _ENGINE)
    dtype: str = setting("bfloat16", "Rollout weight dtype: bfloat16, float16, float32 or auto.", _ENGINE)
    gpu_memory_utilization: float = setting(0.5, "Fraction of device memory the engine may use.", _ENGINE)
    offload_train_optimizer: bool = setting(False, "Integrated mode: offload optimizer state during rollout.",
                                            read(COORDINATOR_SETTINGS, COORDINATOR_RUN))
    offload_train_grad: bool = setting(False, "Integrated mode: offload gradients during rollout.",
                                       read(COORDINATOR_SETTINGS, COORDINATOR_RUN))
    offload_train_param: bool = setting(False, "Integrated mode: offload training weights during rollout.",
                                        read(COORDINATOR_SETTINGS, COORDINATOR_RUN))
    enable_prefix_caching: bool = setting(False, "Reuse KV cache across prompts sharing a prefix.", _ENGINE)
    num_scheduler_steps: int = setting(1, "Scheduler steps per engine step (legacy vLLM).", inert(
        "multi-step scheduling is gone from vLLM's V1 engine, which rlfabric runs"))
    enforce_eager: bool = setting(True, "Run without graph capture.", _ENGINE)
    torchair_graph: bool = setting(False, "vllm-ascend: TorchAir graph mode (graph batch size = max_num_seqs).",
                                   _ASCEND_CONFIG)
    ascend_scheduler_config_enabled: bool = setting(True, "vllm-ascend: use the Ascend scheduler.", _ASCEND_CONFIG)
    enable_expert_parallel: bool = setting(False, "vLLM expert parallelism for MoE layers.", _EXPERT_PARALLEL)
    expert_map_path: str | None = setting(None, "vllm-ascend: expert placement map (EPLB).", _ASCEND_CONFIG)
    eplb_token_collects: bool = setting(False, "MindSpeed-RL EPLB: record tokens per expert.", refused(
        "MindSpeed-RL's EPLB token statistics come from its own vllm-ascend MoE kernel patch, which rlfabric does not "
        "have; the trainer logs moe/expert_load_max_over_mean every iteration"))
    eplb_token_save_path: str = setting("./", "MindSpeed-RL EPLB: where token counts are written.",
                                        inert("only read with eplb_token_collects: true (refused)"))
    limit_mm_image_per_prompt: int = setting(1, "Multimodal: images per prompt.",
                                             refused("rlfabric trains text-only models", feature=MULTIMODAL))
    limit_mm_video_per_prompt: int = setting(0, "Multimodal: videos per prompt.",
                                             refused("rlfabric trains text-only models", feature=MULTIMODAL))
    sampling_config: SamplingConfig = setting(help="Sampling parameters.", factory=SamplingConfig,
                                              status=read(ROLLOUT_OPTIONS))

    def vllm_additional_config(self) -> dict[str, Any]:
        """vLLM's `additional_config` as MindSpeed-RL builds it for vllm-ascend (other platforms ignore it)."""
        return {
            "torchair_graph_config": {
                "enabled": self.torchair_graph,
                "use_cached_graph": False,
                "graph_batch_sizes_init": False,
                "graph_batch_sizes": [self.max_num_seqs] if self.torchair_graph else [],
            },
            "ascend_scheduler_config": {"enabled": self.ascend_scheduler_config_enabled},
            "refresh": True,
            "expert_map_path": self.expert_map_path,
        }


@dataclass(kw_only=True)
class ProfilerConfig:
    """Profiler options for one role (`profiler_config.<role>`, e.g. `integrated`)."""

    profile: bool = setting(False, "Enable the profiler.", _NO_PROFILER)
    mstx: bool = setting(False, "Lightweight (mstx) collection.", _NO_PROFILER)
    stage: str = setting("all", "Phase to profile: all, actor_generate, actor_compute_log_prob, ...", _PROFILE_ONLY)
    profile_save_path: str = setting("", "Directory for profiles.", _PROFILE_ONLY)
    profile_export_type: str = setting("text", "Export format: text or db.", _PROFILE_ONLY)
    profile_level: str = setting("level0", "Detail level: level0, level1, level2, level_none.", _PROFILE_ONLY)
    profile_with_memory: bool = setting(False, "Record memory usage.", _PROFILE_ONLY)
    profile_record_shapes: bool = setting(False, "Record tensor shapes.", _PROFILE_ONLY)
    profile_with_cpu: bool = setting(True, "Record host activity.", _PROFILE_ONLY)
    profile_with_npu: bool = setting(True, "Record device activity.", _PROFILE_ONLY)
    profile_with_module: bool = setting(False, "Record Python call stacks.", _PROFILE_ONLY)
    profile_step_start: int = setting(1, "First iteration profiled.", _PROFILE_ONLY)
    profile_step_end: int = setting(2, "Iteration at which profiling stops.", _PROFILE_ONLY)
    profile_analysis: bool = setting(False, "Analyse profiles online.", _PROFILE_ONLY)
    profile_ranks: str | list[int] = setting("all", "Ranks to profile: all or a list.", _PROFILE_ONLY)


@dataclass(kw_only=True)
class FabricConfig:
    """rlfabric's own keys (`rlfabric:`), for what MindSpeed-RL, one Ray program, has no setting: the services
    talk over a network. Optional; upstream YAMLs have no such section and load unchanged."""

    rpc_deadline_s: float = setting(
        600.0, "Longest one coordinator call to a service (a Generate stream, an Update, a weight push) may take, "
               "in seconds; a call past it fails the iteration naming the service.", read(COORDINATOR_SETTINGS))
    # Periodic validation (MindSpeed-RL's RL trainers have none; Megatron's eval_interval is an LM-loss eval).
    val_interval: int = setting(
        0, "Validate every N iterations, and after the last one, on `val_data_path` with the run's verifiers; "
           "logged as val/* with that iteration's metrics. 0: never.", read(COORDINATOR_VALIDATION))
    val_before_train: bool = setting(
        False, "Also validate the starting weights before the first iteration (logged as iteration 0).",
        read(COORDINATOR_VALIDATION))
    val_data_path: str | None = setting(
        None, "Validation prompts: a dataset prefix preprocessed like megatron_training.data_path, with labels.",
        read(COORDINATOR_VALIDATION))
    val_n_samples: int = setting(
        1, "Samples per validation prompt (val/pass@1; for n > 1 also val/pass@n and val/mean@n).",
        read(COORDINATOR_VALIDATION))
    val_temperature: float = setting(
        0.0, "Sampling temperature of validation; 0 is greedy. Other sampling values are sampling_config's.",
        read(COORDINATOR_VALIDATION))
    # MindSpeed-RL moves weights inside one Ray program; here they cross processes and hosts (WEIGHT_TRANSPORTS).
    weight_transport: str = setting(
        "auto", "How pushed weights reach the rollout replicas. auto: shared memory for replicas on the actor's "
                "host, gRPC streams otherwise. grpc: gRPC streams for every replica. collective: one "
                "torch.distributed group (gloo on CPU; NCCL/HCCL on those devices) of the actor's rank 0 and every "
                "replica, kept across pushes, broadcasting the bytes once; a replica that fails a collective push "
                "gets the version again over gRPC at once.", read(COORDINATOR_SETTINGS))
    # Pipelined (one-step off-policy) mode: MindSpeed-RL is synchronous, which is the default here.
    max_staleness: int = setting(
        0, "Weight versions a trained sample may lag the actor. 0: synchronous (each iteration generates with the "
           "weights the previous update made). 1: pipelined, the rollout generates iteration k+1 with the weights "
           "of k-1 while the actor updates on k; the loss weights off-policy tokens by a truncated importance "
           "ratio. N (up to 4): the rollout runs up to N iterations ahead, starting each further one only while "
           "the update still runs. Disaggregated mode only. Partial rollout (rl_config.partial_rollout_max_split N > 1) lets a "
           "continued response's tokens lag N - 1 versions more.", read(COORDINATOR_SETTINGS, TRAINER_OPTIONS))
    fp32_master_weights: bool = setting(
        True, "With bf16: true, fp32 master weights and optimizer state as Megatron keeps them. false steps the bf16 "
              "weights themselves (pure bf16): a baseline that measures what master weights buy, not an upstream "
              "mode. Unused without bf16.", read(TRAINER_OPTIONS))
    importance_sampling_cap: float = setting(
        2.0, "Truncation of the per-token importance weight old-policy / behaviour-policy applied to the samples "
             "of pipelined mode (max_staleness >= 1) or partial rollout (rl_config.partial_rollout_max_split > 1) "
             "when rollout_is is unset; unused in synchronous mode without partial rollout.",
        read(TRAINER_OPTIONS))
    # verl's estimator, loss and rollout-correction keys (services/common/config/loss_variants.py); MindSpeed-RL
    # has none of them. Unset, the run is MindSpeed-RL's.
    norm_adv_by_std_in_grpo: bool = setting(
        True, "group_norm divides by the group's std (GRPO). false: A = r - mean(group) (Dr.GRPO, with "
              "loss_agg_mode: seq-mean-token-sum-norm).", read(COORDINATOR_SETTINGS, ALGORITHM_VARIANTS))
    policy_loss_mode: PolicyLossMode = setting(
        "vanilla", "vanilla: the clipped token ratio. gspo: GSPO's sequence ratio exp(mean_t log(p / p_old)), "
                   "clipped, aggregated seq-mean-token-mean (verl's actor.policy_loss.loss_mode).",
        read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    loss_agg_mode: LossAggMode | None = setting(
        None, "Aggregation of the policy-gradient term over tokens (verl's actor.loss_agg_mode): token-mean, "
              "seq-mean-token-mean, seq-mean-token-sum, or seq-mean-token-sum-norm (token sums / "
              "loss_scale_factor). Unset: rl_config.token_level_loss decides.", read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    loss_scale_factor: int | None = setting(
        None, "seq-mean-token-sum-norm's divisor; unset: the response length limit (sampling_config.max_tokens, "
              "verl's padded response width).", read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    rollout_is: RolloutIsLevel | None = setting(
        None, "Truncated importance weight p_old / p_rollout on the loss, in every mode (verl's rollout_is): "
              "token (per token) or sequence (the product over the sample). Unset: none in synchronous mode, "
              "token at importance_sampling_cap in pipelined mode or with partial rollout.",
        read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    rollout_is_threshold: float = setting(
        2.0, "Truncation of the rollout_is weight.", read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    rollout_rs: str | None = setting(
        None, "Rejection of tokens or samples whose rollout/trainer divergence passes rollout_rs_threshold "
              "(masked importance sampling, verl's rollout_rs), comma-separated options: token_k1..3, "
              "seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3; their tokens leave the loss.",
        read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    rollout_rs_threshold: str | float | None = setting(
        None, "rollout_rs thresholds: one, or one per option (comma-separated); k1 options take ratio bounds "
              "`lower_upper` (or `upper`: 1/upper..upper).", read(TRAINER_OPTIONS, ALGORITHM_VARIANTS))
    # Reproducibility (MindSpeed-RL's npu_deterministic is an Ascend kernel switch; this is the run's).
    deterministic: bool = setting(
        False, "Bitwise-reproducible runs: two runs of one config on one machine log the same metrics (timings "
               "aside) and save the same checkpoints. Needs generate_config.sampling_config.seed and synchronous "
               "mode; the reference pass then takes its micro-batches in sample order instead of arrival order, "
               "the trainer uses torch's deterministic algorithms, and on GPUs/NPUs vLLM its batch-invariant "
               "kernels (VLLM_BATCH_INVARIANT); docs/running.md, \"Reproducible runs\".",
        read(COORDINATOR_SETTINGS, TRAINER_OPTIONS, ROLLOUT_CLI))
    # MoE: the trainer's router may pick other experts than the rollout's engine did for the same tokens.
    routing_replay: RoutingReplay = setting(
        "none", "MoE routing in training: none (the trainer's router chooses the experts) or rollout (replay the "
                "experts vLLM chose for each sampled token).",
        read(ROLLOUT_CLI, ROUTING_REPLAY))


@dataclass(kw_only=True)
class MsprobeConfig:
    """MindStudio msprobe data-dump options (`msprobe_config`)."""

    msprobe: bool = setting(False, "Enable msprobe dumps.", _NO_MSPROBE)
    dump_path: str = setting("./msprobe_dump", "Dump directory.", _MSPROBE_ONLY)
    key_data_dump: bool = setting(False, "Dump key data.", _MSPROBE_ONLY)
    configurations_dump: bool = setting(False, "Dump configurations.", _MSPROBE_ONLY)
    actor_train_dump: bool = setting(False, "Dump actor training data.", _MSPROBE_ONLY)
    actor_infer_dump: bool = setting(False, "Dump actor inference data.", _MSPROBE_ONLY)
    token_range_start: int = setting(0, "First token dumped.", _MSPROBE_ONLY)
    token_range_end: int = setting(0, "Last token dumped.", _MSPROBE_ONLY)
    reference_dump: bool = setting(False, "Dump reference data.", _MSPROBE_ONLY)
    critic_train_dump: bool = setting(False, "Dump critic data.", _MSPROBE_ONLY)
    step_start: int = setting(0, "First iteration dumped.", _MSPROBE_ONLY)
    step_end: int = setting(0, "Last iteration dumped.", _MSPROBE_ONLY)
