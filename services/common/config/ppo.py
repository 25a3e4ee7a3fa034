"""Rules of PPO with a critic (`megatron_training.stage: ray_ppo`), as MindSpeed-RL's PPO trainer runs it.

MindSpeed-RL (cli/train_ppo.py, trainer/ppo_trainer_hybrid.py) builds a critic from `critic_config` (merged over
`megatron_training`, as `actor_config` is) on `rl_config.critic_resource`, and computes GAE advantages and returns
(`adv_estimator: gae`, `gamma`, `lam`) from the critic's values and the rule score on each response's last token,
with the KL penalty in the reward when `use_kl_in_reward` (the PPO actor loss has no KL term). So here:
- `ray_ppo` needs `critic_config` and `adv_estimator: gae`, and `gae` needs `ray_ppo`: a critic whose values no
  advantage reads, or GAE without a critic, would be another run than the one written;
- `critic_config` outside `ray_ppo`, and `use_kl_in_reward` outside it (MindSpeed-RL's GRPO and DAPO trainers
  never read it), are refused rather than ignored;
- the critic's section needs what a training role needs (`micro_batch_size`, `lr`), and `gamma`, `lam` lie in
  [0, 1], `cliprange_value` is positive;
- what rlfabric's PPO path does not run yet is refused by name: LoRA, multi-turn rollouts and pipelined mode
  (`rlfabric.max_staleness` >= 1) with a critic.
The DAPO-only keys are refused under `ray_ppo` as under `ray_grpo` (algorithm.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

PPO_STAGE = "ray_ppo"
GAE = "gae"


def ppo_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    rl, ppo = cfg.rl_config, cfg.actor_config.stage == PPO_STAGE
    has_critic = cfg.critic_config is not None
    if ppo and not has_critic:
        yield Problem(("stage", "critic_config"),
                      "stage is ray_ppo but the config has no `critic_config`: PPO trains a critic beside the actor; "
                      "add a critic_config section (its model, lr, micro_batch_size, load), as MindSpeed-RL's "
                      "ppo_qwen25_32b_A3.yaml does")
    if has_critic and not ppo:
        yield Problem(("critic_config",), f"`critic_config` is set but stage is `{cfg.actor_config.stage or 'ray_grpo'}`: "
                                          "only PPO (stage: ray_ppo) trains a critic; remove the section or set "
                                          "megatron_training.stage: ray_ppo")
    if ppo and rl.adv_estimator != GAE:
        yield Problem(("rl_config.adv_estimator", "stage"),
                      f"stage is ray_ppo with rl_config.adv_estimator `{rl.adv_estimator}`: the critic's values would "
                      "train without any advantage reading them; PPO uses adv_estimator: gae")
    if rl.adv_estimator == GAE and not ppo:
        yield Problem(("rl_config.adv_estimator", "stage"),
                      "rl_config.adv_estimator `gae` needs a critic, which only stage: ray_ppo (with a critic_config) "
                      "trains; GRPO and DAPO use group_norm (or rloo / reinforce_plus_plus)")
    if rl.use_kl_in_reward and not ppo:
        yield Problem(("rl_config.use_kl_in_reward",),
                      "rl_config.use_kl_in_reward is true but stage is not ray_ppo: MindSpeed-RL's GRPO and DAPO "
                      "trainers never read it (GRPO's KL is a loss term, `init_kl_coef`); remove it")
    if not ppo:
        return
    yield from _critic_section(cfg)
    for key, value in (("rl_config.gamma", rl.gamma), ("rl_config.lam", rl.lam)):
        if not 0.0 <= value <= 1.0:
            yield Problem((key,), f"{key} must lie in [0, 1], got {value}")
    if not rl.cliprange_value > 0:
        yield Problem(("rl_config.cliprange_value",), f"rl_config.cliprange_value must be > 0, got {rl.cliprange_value}")
    for switched_on, key, what in (
            (cfg.actor_config.lora_target_modules is not None, "actor_config.lora_target_modules", "LoRA"),
            (rl.multi_turn_enable, "rl_config.multi_turn_enable", "multi-turn rollouts"),
            (cfg.rlfabric.max_staleness != 0, "rlfabric.max_staleness", "pipelined mode")):
        if switched_on:
            yield Problem((key,), f"{key} asks for {what} with PPO's critic, which rlfabric does not run yet; "
                                  f"train PPO without it, or GRPO with it")


def _critic_section(cfg: RLFabricConfig) -> Iterable[Problem]:
    critic = cfg.critic_config
    if critic is None:
        return
    for key, example in (("micro_batch_size", 1), ("lr", "5e-6")):
        if getattr(critic, key) is None:
            yield Problem((f"critic_config.{key}",), f"`critic_config.{key}` is not set; the critic trains and needs "
                                                     f"it (e.g. `{key}: {example}` in critic_config or "
                                                     f"megatron_training)")
    if critic.lora_target_modules is not None:
        yield Problem(("critic_config.lora_target_modules",),
                      "`critic_config.lora_target_modules` is set: rlfabric's critic trains its full weights")


def critic_save_dir(cfg: RLFabricConfig) -> str:
    """Where the critic's checkpoints go: `critic_config.save`, unless that is the actor's folder (MindSpeed-RL's PPO
    config gives both `./ckpt`, whose iter_* folders would then hold two models' shards under one name) or unset:
    then the `critic` folder inside the actor's."""
    critic, actor = cfg.critic_config, cfg.actor_config
    if critic is not None and critic.save and critic.save != actor.save:
        return str(critic.save)
    return str(Path(actor.save or ".") / "critic")
