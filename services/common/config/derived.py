"""Values computed from a loaded configuration: parallel sizes, batch arithmetic, dispatch sizes.

Pure arithmetic over the section dataclasses, no I/O. Every value is None when its inputs are
missing or not divisible (validation.py reports why), so derivation never raises.

Units: `*_batch_size` and `*_dispatch_size` values here are in SAMPLES (one prompt x one response)
unless the name says prompts; `global_batch_size` and `rl_config.mini_batch_size` are in prompts.

The algorithm (`megatron_training.stage`, see algorithm.py) decides `use_kl_loss` (a KL term in the loss: GRPO
with a non-zero `init_kl_coef`; never DAPO or PPO), `use_reference` (reference log-probs: that KL term, or PPO's KL
in the reward, `use_kl_in_reward`), `critic_trainer` (PPO) and `dynamic_sampling`; under dynamic
sampling an iteration trains `filter_groups_train_batch_size` prompts, which is what the update-side sizes
and the skip-old-log-probs rule (MindSpeed-RL's `set_actor_log_prob_skip_flag`) count.

`world_size` is the number of devices the run uses, as MindSpeed-RL's `world_size` metric counts them
(utils.compute_tps): in integrated mode the actor's devices, which the reference and rollout share;
disaggregated, rlfabric's actor, reference (when there is one) and rollout each hold their own. PPO's critic
(`critic_resource`, unset: the actor's count) always holds devices of its own, as MindSpeed-RL places it.

Experts (MoE models) in megatron-core's terms: `actor_expert_parallel_size` ranks share one copy of the
experts, each split over `actor_expert_tensor_parallel_size` ranks. Without `moe_tp_extend_ep` these are
expert_model_parallel_size (EP) and TP, as in Megatron; with it (MindSpeed) EP x TP and 1: the TP group
holds whole experts instead of slices of each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.config.algorithm import DAPO, GRPO, PPO, algorithm_of
from services.common.config.megatron import MegatronConfig
from services.common.config.rl import RLConfig
from services.common.config.sections import GenerateConfig
from services.common.service_kind import TrainerRole


def _div(a: int | None, b: int | None) -> int | None:
    """a / b when both are set, b > 0 and b divides a; otherwise None."""
    if a is None or b is None or b <= 0 or a % b != 0:
        return None
    return a // b


def _mul(*values: int | None) -> int | None:
    out = 1
    for v in values:
        if v is None:
            return None
        out *= v
    return out


@dataclass(frozen=True)
class Derived:
    """Values every service derives the same way from the YAML (see module docstring for units)."""

    algorithm: str | None
    world_size: int | None
    actor_world_size: int | None
    actor_model_parallel_size: int | None
    actor_data_parallel_size: int | None
    actor_expert_parallel_size: int | None
    actor_expert_tensor_parallel_size: int
    actor_experts_per_rank: int | None
    ref_world_size: int | None
    ref_model_parallel_size: int | None
    ref_data_parallel_size: int | None
    critic_world_size: int | None
    critic_model_parallel_size: int | None
    critic_data_parallel_size: int | None
    rollout_engine_size: int | None
    rollout_data_parallel_size: int | None
    rollout_world_size: int | None
    prompts_per_iteration: int | None
    train_prompts_per_iteration: int | None
    samples_per_iteration: int | None
    samples_per_actor_dp_rank: int | None
    mini_batch_size_samples: int | None
    mini_batches_per_iteration: int | None
    optimizer_steps_per_iteration: int | None
    mini_batch_samples_per_dp_rank: int | None
    micro_batches_per_mini_batch: int | None
    actor_forward_micro_batch_size: int | None
    ref_forward_micro_batch_size: int | None
    actor_rollout_dispatch_size: int | None
    actor_logprob_dispatch_size: int | None
    ref_dispatch_size: int | None
    reward_dispatch_size: int | None
    adv_dispatch_size: int | None
    actor_update_dispatch_size: int | None
    skip_old_log_probs: bool
    use_kl_loss: bool
    # PPO's KL penalty in the reward (rl_config.use_kl_in_reward under ray_ppo), instead of a loss term.
    use_kl_in_reward: bool
    use_reference: bool
    # A reference trainer of its own: reference log-probs, and not LoRA's share_backbone (whose reference is the
    # actor's backbone with its adapters off).
    reference_trainer: bool
    # PPO's critic (stage ray_ppo with a critic_config).
    critic_trainer: bool
    dynamic_sampling: bool
    params_dtype: str
    ref_params_dtype: str
    critic_params_dtype: str | None
    rollout_dtype: str
    max_response_length: int
    max_sequence_length: int
    num_key_value_heads: int | None
    head_dim: int | None
    total_prompts: int | None
    rollout_tokenizer_name_or_path: str | None
    prompt_type_path: str | None
    ref_model_load_path: str | None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def trainer_roles(self) -> list[str]:
        """The trainer groups the run starts: the actor, then the reference and the critic when it has them."""
        return [TrainerRole.ACTOR, *([TrainerRole.REFERENCE] if self.reference_trainer else []),
                *([TrainerRole.CRITIC] if self.critic_trainer else [])]


def _params_dtype(view: MegatronConfig) -> str:
    return "bfloat16" if view.bf16 else "float32"


def _world(resource_npus: int | None) -> int | None:
    return resource_npus if resource_npus is not None and resource_npus > 0 else None


def compute_derived(
    actor: MegatronConfig,
    ref: MegatronConfig,
    rl: RLConfig,
    gen: GenerateConfig,
    *,
    config_dir: Path | None,
    critic: MegatronConfig | None = None,
) -> Derived:
    """Compute the derived values (None where inputs are missing or do not divide)."""
    algorithm = algorithm_of(actor.stage)
    # The KL loss term exists iff GRPO's coefficient is non-zero; DAPO has none, PPO's KL is in the reward.
    use_kl = (algorithm or GRPO) == GRPO and rl.init_kl_coef != 0
    kl_in_reward = algorithm == PPO and rl.use_kl_in_reward
    use_reference = use_kl or kl_in_reward
    critic = critic if algorithm == PPO else None
    dynamic_sampling = algorithm == DAPO and rl.filter_groups_enable
    # DAPO dynamic sampling trains on filter_groups_train_batch_size prompts instead of gbs.
    train_prompts = rl.filter_groups_train_batch_size if dynamic_sampling else actor.global_batch_size
    layout = _layout(actor, ref, rl, gen, use_reference, critic)
    return Derived(
        algorithm=algorithm,
        **layout,
        **_batches(actor, ref, rl, layout, train_prompts),
        # Fully on-policy: one optimizer step per iteration over the trained prompts, so old log-probs equal the
        # current ones and the actor's old-log-prob pass is skipped (MindSpeed-RL's set_actor_log_prob_skip_flag;
        # its PPO trainer also needs them for the KL in the reward).
        skip_old_log_probs=rl.mini_batch_size == train_prompts and rl.epochs == 1 and not kl_in_reward,
        use_kl_loss=use_kl,
        use_kl_in_reward=kl_in_reward,
        use_reference=use_reference,
        reference_trainer=use_reference and not rl.share_backbone,
        critic_trainer=critic is not None,
        dynamic_sampling=dynamic_sampling,
        params_dtype=_params_dtype(actor),
        ref_params_dtype=_params_dtype(ref),
        critic_params_dtype=None if critic is None else _params_dtype(critic),
        rollout_dtype=gen.dtype,
        max_response_length=gen.sampling_config.max_tokens,
        max_sequence_length=rl.max_prompt_length + gen.sampling_config.max_tokens,
        **_model_and_paths(actor, ref, rl, gen, config_dir),
    )


def _layout(actor: MegatronConfig, ref: MegatronConfig, rl: RLConfig, gen: GenerateConfig,
            use_reference: bool, critic: MegatronConfig | None) -> dict[str, int | None]:
    """Devices and parallel sizes of the actor, the reference (None without reference log-probs), PPO's critic
    (None without one) and the rollout."""
    actor_world = _world(rl.actor_resource.num_npus)
    actor_mp = _mul(actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size,
                    actor.context_parallel_size)
    ref_resource = rl.reference_resource if rl.reference_resource is not None else rl.actor_resource
    ref_world = _world(ref_resource.num_npus) if use_reference else None
    critic_resource = rl.critic_resource if rl.critic_resource is not None else rl.actor_resource
    critic_world = _world(critic_resource.num_npus) if critic is not None else None
    critic_mp = None if critic is None else _mul(critic.tensor_model_parallel_size,
                                                 critic.pipeline_model_parallel_size, critic.context_parallel_size)
    ref_mp = _mul(ref.tensor_model_parallel_size, ref.pipeline_model_parallel_size, ref.context_parallel_size)
    engine = _mul(gen.infer_tensor_parallel_size, gen.infer_pipeline_parallel_size)
    rollout_dp = _div(actor_world, engine)
    rollout_world = _mul(rollout_dp, engine)
    if rl.use_integrated_worker:
        world = actor_world
    else:
        world = None if None in (actor_world, rollout_world) else actor_world + rollout_world + (ref_world or 0)
    if world is not None and critic is not None:
        world = None if critic_world is None else world + critic_world
    return dict(world_size=world, actor_world_size=actor_world, actor_model_parallel_size=actor_mp,
                actor_data_parallel_size=_div(actor_world, actor_mp), **_experts(actor), ref_world_size=ref_world,
                ref_model_parallel_size=ref_mp, ref_data_parallel_size=_div(ref_world, ref_mp),
                critic_world_size=critic_world, critic_model_parallel_size=critic_mp,
                critic_data_parallel_size=_div(critic_world, critic_mp),
                rollout_engine_size=engine, rollout_data_parallel_size=rollout_dp, rollout_world_size=rollout_world)


def _experts(actor: MegatronConfig) -> dict[str, int | None]:
    """The actor's expert layout in megatron-core's terms (see module docstring)."""
    tp, ep = actor.tensor_model_parallel_size, actor.expert_model_parallel_size
    extend = actor.moe_tp_extend_ep
    expert_ep = _mul(ep, tp) if extend else ep
    return dict(actor_expert_parallel_size=expert_ep, actor_expert_tensor_parallel_size=1 if extend else tp,
                actor_experts_per_rank=_div(actor.num_experts, expert_ep))


def _batches(actor: MegatronConfig, ref: MegatronConfig, rl: RLConfig, layout: dict[str, int | None],
             train_prompts: int | None) -> dict[str, int | None]:
    """Batch arithmetic in samples; update-side sizes count the trained prompts."""
    n, gbs, actor_dp = rl.n_samples_per_prompt, actor.global_batch_size, layout["actor_data_parallel_size"]
    samples, train_samples = _mul(gbs, n), _mul(train_prompts, n)
    mini_samples = _mul(rl.mini_batch_size, n)
    mini_batches = _div(train_prompts, rl.mini_batch_size)
    mini_per_rank = _div(mini_samples, actor_dp)
    return dict(
        prompts_per_iteration=gbs,
        train_prompts_per_iteration=train_prompts,
        samples_per_iteration=samples,
        samples_per_actor_dp_rank=_div(samples, actor_dp),
        mini_batch_size_samples=mini_samples,
        mini_batches_per_iteration=mini_batches,
        optimizer_steps_per_iteration=_mul(mini_batches, rl.epochs),
        mini_batch_samples_per_dp_rank=mini_per_rank,
        micro_batches_per_mini_batch=_div(mini_per_rank, actor.micro_batch_size),
        actor_forward_micro_batch_size=rl.actor_forward_micro_batch_size or actor.micro_batch_size,
        ref_forward_micro_batch_size=rl.ref_forward_micro_batch_size or ref.micro_batch_size,
        actor_rollout_dispatch_size=rl.actor_rollout_dispatch_size or _div(samples,
                                                                           layout["rollout_data_parallel_size"]),
        actor_logprob_dispatch_size=rl.actor_logprob_dispatch_size or _div(train_samples, actor_dp),
        ref_dispatch_size=rl.ref_dispatch_size or _div(samples, layout["ref_data_parallel_size"]),
        reward_dispatch_size=rl.reward_dispatch_size or samples,
        adv_dispatch_size=rl.adv_dispatch_size or train_samples,
        actor_update_dispatch_size=rl.actor_update_dispatch_size or _div(train_samples, actor_dp),
        total_prompts=_mul(actor.train_iters, gbs),
    )


def _model_and_paths(actor: MegatronConfig, ref: MegatronConfig, rl: RLConfig, gen: GenerateConfig,
                     config_dir: Path | None) -> dict[str, int | str | None]:
    """Attention shape of the actor's model block, and the paths services resolve."""
    kv_heads = None
    if actor.num_attention_heads is not None:
        kv_heads = actor.num_query_groups if actor.group_query_attention else actor.num_attention_heads
    head_dim = actor.kv_channels
    if head_dim is None:
        head_dim = _div(actor.hidden_size, actor.num_attention_heads)
    prompt_type_path = actor.prompt_type_path
    if prompt_type_path is None and config_dir is not None:
        prompt_type_path = str(config_dir / "model" / "templates.json")
    integrated = rl.integrated_mode_config
    ref_load = integrated.ref_model_load_path if integrated is not None else None
    return dict(num_key_value_heads=kv_heads, head_dim=head_dim,
                rollout_tokenizer_name_or_path=gen.tokenizer_name_or_path or actor.tokenizer_name_or_path,
                prompt_type_path=prompt_type_path, ref_model_load_path=ref_load if ref_load is not None else ref.load)
