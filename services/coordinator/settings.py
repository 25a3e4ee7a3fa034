"""What one GRPO iteration takes from the configuration: `IterationSettings` and `settings_from_config`.

Every value comes from the loaded `RLFabricConfig` (services/common/config): the config's fields are the one
home of each default, so IterationSettings has none of its own (except `update_chunk_size`, an rlfabric
wire detail with no YAML key, and the advantage / rollout-correction fields, defaulting to the plain GRPO run for
evaluation's settings, which train nothing). Rules such as "is there a KL term" or "can old log-probs be skipped"
are read from `cfg.derived`, never re-derived here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.config.loss_variants import rollout_correction_on
from services.common.weight_version import staleness_bound
from services.coordinator.multi_turn import MultiTurnSettings


@dataclass(frozen=True)
class IterationSettings:
    """What one iteration needs from the config (built by `settings_from_config`)."""

    # Sampling (generate_config.sampling_config).
    n_samples_per_prompt: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    # The run's sampling seed (sampling_config.seed, or one drawn for the run and journaled; see RunDriver).
    seed: int | None
    # Rewards: (verifier_function, verifier_weight) pairs, and DAPO overlong shaping.
    verifiers: tuple[tuple[str, float], ...]
    overlong_buffer_enable: bool
    overlong_buffer: int
    overlong_buffer_penalty_factor: float
    rollout_max_tokens: int
    # DAPO dynamic sampling (rl_config.filter_groups_*).
    filter_groups_enable: bool
    filter_groups_metric: str
    filter_groups_max_batches: int
    filter_groups_train_batch_size: int
    # Loss inputs.
    use_reference: bool  # cfg.derived.use_reference: a KL term (loss or PPO reward), hence reference log-probs
    skip_old_log_probs: bool  # cfg.derived.skip_old_log_probs
    kl_ctrl_type: str
    init_kl_coef: float
    kl_target: float | None
    kl_horizon: float | None
    # Forward passes, in rows per request.
    ref_forward_micro_batch_size: int | None  # None only without a reference (no KL term)
    actor_forward_micro_batch_size: int
    # Placement: integrated (all-shared-device) mode and what the actor offloads in it.
    use_integrated_worker: bool
    offload_train_param: bool
    offload_train_grad: bool
    offload_train_optimizer: bool
    # Metrics.
    global_batch_size: int
    world_size: int
    log_max_throughput: bool
    # rlfabric.rpc_deadline_s: the deadline of each call to another service that does a phase's work (the other
    # calls' fixed deadlines: services/common/deadlines.py).
    deadline_s: float
    # rlfabric.max_staleness: 0 synchronous, 1 pipelined (the rollout one iteration ahead of the update).
    max_staleness: int
    # rlfabric.weight_transport: auto (shm on the actor's host, else gRPC), grpc or collective.
    weight_transport: str = "auto"
    # Rows per UpdateRequest message (one Update call carries the whole batch in chunks of this size).
    update_chunk_size: int = 64
    # Advantages: rl_config.adv_estimator and rlfabric.norm_adv_by_std_in_grpo (services/coordinator/advantages.py).
    adv_estimator: str = "group_norm"
    norm_adv_by_std_in_grpo: bool = True
    # rlfabric.rollout_is / rollout_rs set: the rollout's log-probs travel with the batch in every mode.
    rollout_correction: bool = False
    # generate_config.max_model_len: a prompt's response gets at most what is left of it (see response_budget).
    max_model_len: int | None = None
    # rlfabric.deterministic: the reference pass takes its micro-batches in sample order, not arrival order.
    deterministic: bool = False
    # rl_config.share_backbone (LoRA): the reference is the actor's backbone, its log-probs the actor's
    # ComputeLogProbs with adapters_off; there is no reference trainer.
    share_backbone: bool = False
    # PPO (stage: ray_ppo): a critic trainer, GAE's gamma and lam, and the critic's rows per ComputeValues request
    # (its micro_batch_size, as MindSpeed-RL's critic forward reads it).
    use_critic: bool = False
    gamma: float = 1.0
    lam: float = 1.0
    critic_forward_micro_batch_size: int = 1
    # PPO's KL in the reward (rl_config.use_kl_in_reward): the kl_penalty estimator of the old policy against the
    # reference, times the KL controller's coefficient, taken off each token's reward before GAE.
    use_kl_in_reward: bool = False
    kl_penalty: str = "low_var_kl"
    # A KL term in the actor's loss (GRPO's with a non-zero coefficient; Derived.use_kl_loss).
    kl_in_loss: bool = False
    # rl_config.partial_rollout_max_split: N > 1 generates responses in chunks of max_tokens // N, continuing a
    # cut response in a later iteration (partial_rollout.py); 1 generates each response whole.
    partial_rollout_max_split: int = 1
    # With partial rollout: rl_config.async_engine (a round runs each response to its end, interrupted once
    # global_batch_size groups are complete) and require_max_age_all_finished (the interrupt waits for the responses at
    # their last split).
    async_engine: bool = False
    require_max_age_all_finished: bool = True

    @property
    def staleness_bound(self) -> int:
        """Weight versions any trained token may lag the actor (the version fence; weight_version.py)."""
        return staleness_bound(self.max_staleness, self.partial_rollout_max_split)

    @property
    def off_policy(self) -> bool:
        """Whether trained tokens may come from older weights than the actor's (pipelined or partial rollout)."""
        return self.staleness_bound > 0

    def response_budget(self, prompt_length: int) -> int:
        """max_tokens for a prompt of `prompt_length` tokens: what max_model_len leaves, if less (upstream's vLLM
        stops there; the rollout service refuses a request that asks for more, so the coordinator asks for it)."""
        if self.max_model_len is None or prompt_length >= self.max_model_len:
            return self.max_tokens  # no room at all: the rollout fails that sample, naming max_model_len
        return min(self.max_tokens, self.max_model_len - prompt_length)


def settings_from_config(cfg: Any) -> IterationSettings:
    """IterationSettings from a loaded `RLFabricConfig` (see services/common/config)."""
    rl, sampling, derived = cfg.rl_config, cfg.generate_config.sampling_config, cfg.derived
    return IterationSettings(
        n_samples_per_prompt=rl.n_samples_per_prompt,
        max_tokens=sampling.max_tokens,
        max_model_len=cfg.generate_config.max_model_len,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        verifiers=tuple(zip(rl.verifier_function, (float(w) for w in rl.verifier_weight), strict=True)),
        overlong_buffer_enable=rl.overlong_buffer_enable,
        overlong_buffer=rl.overlong_buffer,
        overlong_buffer_penalty_factor=rl.overlong_buffer_penalty_factor,
        rollout_max_tokens=rl.rollout_max_tokens,
        filter_groups_enable=rl.filter_groups_enable,
        filter_groups_metric=rl.filter_groups_metric,
        filter_groups_max_batches=rl.filter_groups_max_batches,
        filter_groups_train_batch_size=rl.filter_groups_train_batch_size,
        use_reference=derived.use_reference,
        skip_old_log_probs=derived.skip_old_log_probs,
        kl_ctrl_type=rl.kl_ctrl_type,
        init_kl_coef=rl.init_kl_coef,
        kl_target=rl.kl_target,
        kl_horizon=rl.kl_horizon,
        ref_forward_micro_batch_size=derived.ref_forward_micro_batch_size,
        actor_forward_micro_batch_size=derived.actor_forward_micro_batch_size,
        use_integrated_worker=rl.use_integrated_worker,
        offload_train_param=cfg.generate_config.offload_train_param,
        offload_train_grad=cfg.generate_config.offload_train_grad,
        offload_train_optimizer=cfg.generate_config.offload_train_optimizer,
        global_batch_size=int(cfg.actor_config.global_batch_size),
        world_size=derived.world_size,
        log_max_throughput=rl.log_max_throughput,
        deadline_s=cfg.rlfabric.rpc_deadline_s,
        max_staleness=cfg.rlfabric.max_staleness,
        weight_transport=cfg.rlfabric.weight_transport,
        adv_estimator=rl.adv_estimator,
        norm_adv_by_std_in_grpo=cfg.rlfabric.norm_adv_by_std_in_grpo,
        rollout_correction=rollout_correction_on(cfg.rlfabric),
        deterministic=cfg.rlfabric.deterministic,
        share_backbone=derived.use_reference and not derived.reference_trainer,
        use_critic=derived.critic_trainer,
        gamma=rl.gamma,
        lam=rl.lam,
        critic_forward_micro_batch_size=(cfg.critic_config.micro_batch_size if derived.critic_trainer else 1),
        use_kl_in_reward=derived.use_kl_in_reward,
        kl_in_loss=derived.use_kl_loss,
        kl_penalty=rl.kl_penalty,
        partial_rollout_max_split=rl.partial_rollout_max_split,
        async_engine=rl.async_engine,
        require_max_age_all_finished=rl.require_max_age_all_finished,
    )


def multi_turn_settings(cfg: Any) -> MultiTurnSettings | None:
    """The multi-turn keys (`rl_config.multi_turn_enable` and companions; checked when the config loaded), or None."""
    rl = cfg.rl_config
    if not rl.multi_turn_enable:
        return None
    return MultiTurnSettings(
        max_tool_calls=rl.max_tool_calls,
        max_parallel_calls=rl.max_parallel_calls,
        max_total_response_length=rl.max_total_response_length,
        max_tool_response_length=rl.max_tool_response_length,
        truncate_side=rl.tool_response_truncate_side or "middle",
        tool_parser_format=rl.tool_parser_format or "hermes",
        tool_config_path=str(rl.tool_config_path),
    )
