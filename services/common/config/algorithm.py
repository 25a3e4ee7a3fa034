"""Which algorithm a config trains (`megatron_training.stage`), and what each one reads.

What MindSpeed-RL does, read from its source (cli/train_*.py, trainer/*_trainer_hybrid.py,
models/loss/*_actor_loss_func.py, models/rule_verifier.py):
- `ray_grpo`: the GRPO trainer and loss. A reference model and a KL term `kl_ctrl * kl_penalty(logp, ref)`;
  token-mean over the micro-batch and the symmetric clip `clip_ratio`, always: the GRPO loss never reads
  `token_level_loss` or `clip_higher_*`, and the GRPO trainer never filters groups (`filter_groups_*`).
- `ray_dapo`: the DAPO trainer, built without a reference worker, and the DAPO loss, whose KL term is
  zero whatever `init_kl_coef` says; `token_level_loss`, `clip_higher_enable` / `clip_ratio_low/high`
  and dynamic sampling (`filter_groups_*`) are read from their keys.
- Both: overlong reward shaping (`overlong_buffer_*`) lives in the rule reward, keyed by its own switch.
- `ray_ppo`: PPO, the same actor loss without a KL term, a critic (`critic_config`) and GAE advantages; its own
  rules are ppo.py's. As under `ray_grpo`, the DAPO-only keys are refused.
- `dpo` is another program; rlfabric refuses it naming the feature.

So rlfabric refuses what upstream would silently ignore, instead of ignoring it too: the DAPO-only keys
switched on under `ray_grpo`, and a non-zero `init_kl_coef` written in a `ray_dapo` config (upstream's
DAPO has no KL term and no reference model; "no KL unless asked" has no way to ask there, so asking is
an error, not a different run). An unset `stage` trains GRPO (MindSpeed-RL requires the key).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.loss_variants import loss_variant_rules
from services.common.config.problems import Problem
from services.common.config.statuses import DPO

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig
GRPO, DAPO, PPO = "grpo", "dapo", "ppo"
ALGORITHMS = {"ray_grpo": GRPO, "ray_dapo": DAPO, "ray_ppo": PPO}
# Stages of MindSpeed-RL that rlfabric does not train: each names the feature it would need.
OTHER_STAGES = {"dpo": DPO, "ray_dpo": DPO}
# Keys only the KL term reads: inactive when there is none (DAPO, or init_kl_coef 0).
KL_KEYS = ("rl_config.init_kl_coef", "rl_config.kl_penalty", "rl_config.kl_ctrl_type", "rl_config.kl_horizon",
           "rl_config.kl_target", "rl_config.ref_forward_micro_batch_size", "rl_config.ref_dispatch_size")


def algorithm_of(stage: str | None) -> str | None:
    """"grpo", "dapo" or "ppo" for a stage rlfabric trains (unset: grpo); None for any other stage."""
    if stage is None:
        return GRPO
    return ALGORITHMS.get(stage)


def stage_feature(stage: str | None) -> str | None:
    """The feature a stage of MindSpeed-RL that rlfabric does not train stands for (DPO), else None."""
    return OTHER_STAGES.get(stage) if stage is not None else None


def algorithm_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    """Refuse what the selected algorithm would ignore upstream (see module docstring)."""
    stage, rl = cfg.actor_config.stage, cfg.rl_config
    yield from loss_variant_rules(cfg)
    algorithm = algorithm_of(stage)
    if algorithm is None:
        if stage_feature(stage) is None:  # DPO stages are refused as features, by the loader
            yield Problem(("stage",), f"stage `{stage}` is not an algorithm rlfabric trains; use ray_grpo (GRPO), "
                                      f"ray_dapo (DAPO) or ray_ppo (PPO)")
        return
    if algorithm in (GRPO, PPO):
        dapo_only = [(rl.clip_higher_enable, "rl_config.clip_higher_enable", "clip-higher"),
                     (not rl.token_level_loss, "rl_config.token_level_loss", "sequence-mean-token-mean loss"),
                     (rl.filter_groups_enable, "rl_config.filter_groups_enable", "dynamic sampling")]
        for switched_on, key, what in dapo_only:
            if switched_on:
                name = "PPO" if algorithm == PPO else "GRPO"
                yield Problem((key,), f"{key} asks for DAPO's {what}, but stage is `{stage or 'ray_grpo'}`: "
                                      f"MindSpeed-RL's {name} ignores it. Set megatron_training.stage: ray_dapo, "
                                      f"or remove {key.split('.')[-1]}")
    elif rl.init_kl_coef != 0 and "rl_config.init_kl_coef" in cfg.provenance.sources:
        yield Problem(("rl_config.init_kl_coef",),
                      f"rl_config.init_kl_coef is {rl.init_kl_coef} but stage is ray_dapo: MindSpeed-RL's DAPO has "
                      f"no KL term and no reference model, whatever init_kl_coef says. Remove init_kl_coef (or set "
                      f"it to 0.0), or train with stage: ray_grpo to have a KL term")


def inactive_keys(cfg: RLFabricConfig) -> dict[str, str]:
    """Keys the file sets that the selected algorithm does not read: dotted key -> why."""
    rl, algorithm = cfg.rl_config, algorithm_of(cfg.actor_config.stage)
    out: dict[str, str] = {}
    if algorithm == PPO:
        if not rl.use_kl_in_reward:  # PPO's actor loss has no KL term; its KL is the reward's, when asked
            out.update(dict.fromkeys(KL_KEYS, "ray_ppo without use_kl_in_reward has no KL (its actor loss has none)"))
    elif not cfg.derived.use_kl_loss:
        why = ("ray_dapo has no KL term" if algorithm == DAPO else "init_kl_coef is 0: no KL term, no reference model")
        out.update(dict.fromkeys(KL_KEYS, why))
    if not rl.clip_higher_enable:
        out.update(dict.fromkeys(("rl_config.clip_ratio_low", "rl_config.clip_ratio_high"),
                                 "clip_higher_enable is false: the clip range is clip_ratio"))
    if cfg.rlfabric.policy_loss_mode == "gspo":
        out["rl_config.token_level_loss"] = "rlfabric.policy_loss_mode gspo always aggregates seq-mean-token-mean"
    elif algorithm in (GRPO, PPO):
        out["rl_config.token_level_loss"] = f"ray_{algorithm}'s loss is always token-level"
    elif rl.clip_higher_enable:
        out["rl_config.clip_ratio"] = "clip_higher_enable is true: clip_ratio_low / clip_ratio_high apply"
    return {key: why for key, why in out.items() if key in cfg.provenance.sources}
