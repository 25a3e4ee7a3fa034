"""The trainer's roles and the Megatron section of a config each one reads (standard library only: launch.py uses it
before torch is imported).

- "actor": trains the policy (`actor_config`, the merged view model block < megatron_training < actor_config);
- "reference": the frozen policy of the KL term (`ref_config`, the actor's view when the YAML has none);
- "critic": PPO's value model (`critic_config`, model block < megatron_training < critic_config; services/trainer/
  value_head.py).
"""

from __future__ import annotations

from services.common.service_kind import TrainerRole

ACTOR, REFERENCE, CRITIC = TrainerRole.ACTOR, TrainerRole.REFERENCE, TrainerRole.CRITIC
ROLES = tuple(r.value for r in TrainerRole)  # plain strings: argparse quotes its choices with repr()
# The roles that train: an optimizer, Update, checkpoints with optimizer state.
TRAINING_ROLES = (ACTOR, CRITIC)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(repr(r) for r in ROLES)}, got {role!r}")
    return role


def megatron_section(cfg, role: str):
    """The MegatronConfig view `role` reads from an RLFabricConfig; a ValueError for a critic without
    `critic_config` (only PPO, `stage: ray_ppo`, has one)."""
    check_role(role)
    if role == CRITIC:
        if getattr(cfg, "critic_config", None) is None:
            raise ValueError("the critic reads critic_config, which this config has not: PPO's critic needs a "
                             "critic_config section (and megatron_training.stage: ray_ppo)")
        return cfg.critic_config
    return cfg.actor_config if role == ACTOR else cfg.ref_config


def update_timing_key(role: str) -> str:
    """The Update reply's timing metric: `timing/update_critic` for the critic (upstream's name), else
    `timing/update`."""
    return "timing/update_critic" if role == CRITIC else "timing/update"
