"""WorkerOptions from a MindSpeed-RL configuration (the only place that reads config for the trainer).

Values the config package derives (forward micro-batch sizes, params dtype, the reference's weights) are
read from `cfg.derived`, never re-derived here; the rule that a resumed run names its reference weights
is enforced when the config loads (services/common/config/resume.py).
"""

from __future__ import annotations

from services.common import pipeline_layout
from services.common.config.loss_variants import parse_rs
from services.common.weight_version import staleness_bound
from services.trainer import roles
from services.trainer.activation_memory import ActivationMemory
from services.trainer.grpo_loss import LossVariant
from services.trainer.lora import LoraOptions
from services.trainer.moe import MoeOptions
from services.trainer.optimizer import OptimizerOptions
from services.trainer.packing import DEFAULT_MAX_PACKING_TOKENS, Packing
from services.trainer.rollout_correction import RolloutCorrection
from services.trainer.update import UpdateOptions
from services.trainer.worker import WorkerOptions


def worker_options_from_config(cfg, role: str = "actor", *, hf_dir: str | None = None) -> tuple[WorkerOptions, float]:
    """(WorkerOptions, kl_coef) for `role` ("actor", "reference" or "critic") from an RLFabricConfig."""
    roles.check_role(role)
    if role == roles.CRITIC:
        return critic_options_from_config(cfg, hf_dir=hf_dir), cfg.rl_config.init_kl_coef
    actor = role == "actor"
    mt = cfg.actor_config if actor else cfg.ref_config
    rl, d = cfg.rl_config, cfg.derived
    opts = WorkerOptions(
        role=role,
        hf_dir=hf_dir or mt.tokenizer_name_or_path,
        load=mt.load if actor else d.ref_model_load_path,
        finetune=bool(mt.finetune) if actor else True,
        no_load_optim=bool(mt.no_load_optim),
        no_load_rng=bool(mt.no_load_rng),
        forward_micro_batch_size=d.actor_forward_micro_batch_size if actor else d.ref_forward_micro_batch_size,
        forward_packing=(_packing(rl, "actor", rl.actor_max_packing_token_size, rl.actor_dynamic_max_batch_size)
                         if actor else
                         _packing(rl, "ref", rl.ref_max_packing_token_size, rl.ref_dynamic_max_batch_size)),
        # The reference never updates: of these settings it reads only the seed (its model-parallel RNG), and its
        # section need not set the update keys (lr, micro_batch_size) that the actor's must.
        update=update_options_from_config(cfg) if actor else UpdateOptions(seed=mt.seed),
        optimizer=optimizer_options_from_config(cfg) if actor else OptimizerOptions(),
        params_dtype=d.params_dtype if actor else d.ref_params_dtype,
        activation_memory=activation_memory_from_config(mt),
        moe=moe_options_from_config(mt),
        stage_layers=stage_layers_from_config(mt),
        deterministic=cfg.rlfabric.deterministic,
        # The reference is the base model: never adapters.
        lora=lora_options_from_config(mt) if actor else None,
        lora_ckpt_filter=bool(mt.lora_ckpt_filter) if actor else False,
    )
    return opts, rl.init_kl_coef


def critic_options_from_config(cfg, *, hf_dir: str | None = None) -> WorkerOptions:
    """PPO's critic from `cfg.critic_config` (model block < megatron_training < critic_config) and rl_config, as
    MindSpeed-RL's critic worker reads them: its load / finetune / no_load_*, its micro_batch_size for the update and
    the value pass alike, its optimizer keys, parallel sizes and precision; rl_config's mini-batches, epochs and
    shuffle as the actor's, `cliprange_value`, and under use_dynamic_bsz the `max_packing_token_size` /
    `dynamic_max_batch_size` budgets (the keys upstream's critic worker hands its engine; the per-pass keys are the
    actor's and the reference's)."""
    mt, rl = roles.megatron_section(cfg, roles.CRITIC), cfg.rl_config
    budget = _packing(rl, "", rl.max_packing_token_size, rl.dynamic_max_batch_size)
    return WorkerOptions(
        role=roles.CRITIC,
        hf_dir=hf_dir or mt.tokenizer_name_or_path,
        load=mt.load,
        finetune=bool(mt.finetune),
        no_load_optim=bool(mt.no_load_optim),
        no_load_rng=bool(mt.no_load_rng),
        forward_micro_batch_size=mt.micro_batch_size,
        forward_packing=budget,
        update=UpdateOptions(
            micro_batch_size=mt.micro_batch_size,
            mini_batch_rows=rl.mini_batch_size * rl.n_samples_per_prompt,
            epochs=rl.epochs,
            shuffle_mini_batch=rl.shuffle_mini_batch,
            seed=mt.seed,
            cliprange_value=rl.cliprange_value,
            packing=budget,
            use_kl=False,  # the policy-loss settings are the actor's; the critic's loss has no KL term
        ),
        optimizer=optimizer_options_from_section(mt, cfg.rlfabric.fp32_master_weights),
        params_dtype=cfg.derived.critic_params_dtype,
        activation_memory=activation_memory_from_config(mt),
        moe=moe_options_from_config(mt),
        stage_layers=stage_layers_from_config(mt),
        deterministic=cfg.rlfabric.deterministic,
        init_method_std=mt.init_method_std,
    )


def lora_options_from_config(mt) -> LoraOptions | None:
    """The actor's LoRA (`lora_r`, `lora_alpha`, `lora_target_modules`; checked when the config loaded,
    services/common/config/lora.py); None when `lora_target_modules` is unset (full weights). The adapters' A is
    drawn from the run's `seed`, so a run and its rerun start from the same adapters."""
    if mt.lora_target_modules is None:
        return None
    return LoraOptions(rank=int(mt.lora_r), alpha=float(mt.lora_alpha), target_modules=tuple(mt.lora_target_modules),
                       seed=int(mt.seed))


def update_options_from_config(cfg) -> UpdateOptions:
    """The actor's update settings (micro_batch_size is required when the config loads)."""
    mt, rl = cfg.actor_config, cfg.rl_config
    return UpdateOptions(
        micro_batch_size=mt.micro_batch_size,
        mini_batch_rows=rl.mini_batch_size * rl.n_samples_per_prompt,
        epochs=rl.epochs,
        shuffle_mini_batch=rl.shuffle_mini_batch,
        seed=mt.seed,
        clip_ratio=rl.clip_ratio,
        clip_ratio_low=rl.clip_ratio_low if rl.clip_higher_enable else None,
        clip_ratio_high=rl.clip_ratio_high if rl.clip_higher_enable else None,
        kl_penalty=rl.kl_penalty,
        use_kl=cfg.derived.use_kl_loss,
        entropy_coeff=rl.entropy_coeff,
        token_level_loss=rl.token_level_loss,
        is_cap=cfg.rlfabric.importance_sampling_cap,
        variant=loss_variant_from_config(cfg),
        max_staleness=staleness_bound(cfg.rlfabric.max_staleness, rl.partial_rollout_max_split),
        packing=_packing(rl, "update", rl.update_max_packing_token_size, rl.update_dynamic_max_batch_size),
    )


def optimizer_options_from_config(cfg) -> OptimizerOptions:
    """The actor's optimizer and LR schedule (lr and train_iters are required when the config loads)."""
    return optimizer_options_from_section(cfg.actor_config, cfg.rlfabric.fp32_master_weights)


def optimizer_options_from_section(mt, master_weights: bool = True) -> OptimizerOptions:
    """The optimizer and LR schedule of one training role's Megatron section (`rlfabric.fp32_master_weights`)."""
    # An unset lr_warmup_fraction means no warmup.
    warmup = 0 if mt.lr_warmup_fraction is None else int(mt.lr_warmup_fraction * mt.train_iters)
    return OptimizerOptions(
        lr=mt.lr,
        min_lr=mt.min_lr,
        lr_decay_style=mt.lr_decay_style,
        lr_warmup_iters=warmup,
        train_iters=mt.train_iters,
        weight_decay=mt.weight_decay,
        adam_beta1=mt.adam_beta1,
        adam_beta2=mt.adam_beta2,
        clip_grad=mt.clip_grad,
        use_distributed_optimizer=mt.use_distributed_optimizer,
        reuse_fp32_param=mt.reuse_fp32_param,
        master_weights=master_weights,
    )


def stage_layers_from_config(mt) -> tuple[int, ...] | None:
    """The model's layers on each pipeline stage under `num_layer_list` / `noop_layers` (validated when the config
    loaded; services/common/pipeline_layout.py); None without them: the even split at whatever PP the trainer runs
    (`trainer serve --pp` may override the config's)."""
    if mt.num_layer_list is None and mt.noop_layers is None:
        return None
    return pipeline_layout.stage_layers(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list,
                                        mt.noop_layers)


def loss_variant_from_config(cfg) -> LossVariant:
    """verl's loss keys (`rlfabric.*`, checked when the config loaded; services/common/config/loss_variants.py).

    The rollout correction: `rollout_is` when set, else a token-level truncation at `importance_sampling_cap`
    whenever a trained token can be off-policy (pipelined mode, `max_staleness` >= 1, or partial rollout,
    `partial_rollout_max_split` > 1: a continued response's earlier tokens came from older weights), plus the
    `rollout_rs` rejection. Synchronous mode without partial rollout or either key measures only: the rollout's
    log-probs still come with each batch whose old-log-prob pass is skipped, for `rollout_mismatch/*`, and leave
    the loss as it is.
    """
    fab = cfg.rlfabric
    if fab.rollout_is is not None:
        level, threshold = fab.rollout_is, fab.rollout_is_threshold
    else:
        off_policy = fab.max_staleness or cfg.rl_config.partial_rollout_max_split > 1
        level, threshold = ("token" if off_policy else None), fab.importance_sampling_cap
    correction = RolloutCorrection(level, threshold, parse_rs(fab.rollout_rs, fab.rollout_rs_threshold))
    scale = fab.loss_scale_factor
    if scale is None and fab.loss_agg_mode == "seq-mean-token-sum-norm":
        scale = cfg.derived.max_response_length  # verl pads responses to their length limit and divides by it
    return LossVariant(policy_loss_mode=fab.policy_loss_mode, loss_agg_mode=fab.loss_agg_mode,
                       loss_scale_factor=None if scale is None else float(scale), correction=correction)


def _packing(rl, prefix: str, max_tokens: int | None, max_rows: int | None) -> Packing:
    """One pass's packing: use_remove_padding, and under use_dynamic_bsz its token and row budgets.

    An unset budget is MindSpeed-RL's default (RLConfig copies max_packing_token_size's and
    dynamic_max_batch_size's defaults into the per-pass keys before it reads the YAML, so those two keys reach no
    actor or reference pass; PPO's critic reads them, critic_options_from_config).
    """
    if not rl.use_dynamic_bsz:
        return Packing(remove_padding=rl.use_remove_padding, key_prefix=prefix)
    budget = DEFAULT_MAX_PACKING_TOKENS if max_tokens is None else max_tokens
    return Packing(remove_padding=rl.use_remove_padding, max_tokens=budget, max_rows=max_rows, key_prefix=prefix)


def activation_memory_from_config(mt) -> ActivationMemory:
    """The activation-memory keys of one role's Megatron section (validated when the config loaded)."""
    return ActivationMemory(
        recompute_granularity=mt.recompute_granularity,
        recompute_method=mt.recompute_method,
        recompute_num_layers=mt.recompute_num_layers,
        recompute_activation_function=mt.recompute_activation_function,
        sequence_parallel=mt.sequence_parallel,
        swap_attention=mt.swap_attention,
    )


def moe_options_from_config(mt) -> MoeOptions:
    """The MoE training keys of one role's Megatron section (validated when the config loaded; unused when dense).

    An unset `moe_token_dispatcher_type` is Megatron's allgather; MindSpeed's `alltoall_seq` runs as
    megatron-core's alltoall, which replaced it (the same math).
    """
    dispatcher = mt.moe_token_dispatcher_type or "allgather"
    return MoeOptions(
        moe_aux_loss_coeff=mt.moe_aux_loss_coeff,
        moe_router_load_balancing_type=mt.moe_router_load_balancing_type,
        moe_token_dispatcher_type="alltoall" if dispatcher == "alltoall_seq" else dispatcher,
        moe_router_enable_expert_bias=mt.moe_router_enable_expert_bias,
    )
