"""Rules of MindSpeed-RL's partial rollout (`rl_config.partial_rollout_max_split` N > 1;
services/coordinator/partial_rollout.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig


def partial_rollout(cfg: RLFabricConfig) -> Iterable[Problem]:
    """MindSpeed-RL's partial rollout (`rl_config.partial_rollout_max_split` N > 1): each iteration generates at most
    max_tokens // N tokens of a response and continues a cut one in a later iteration, with newer weights. Upstream
    asserts max_tokens divisible by N; rlfabric continues only single-turn responses of a run without dynamic
    sampling, a critic or routing replay. `rlfabric.deterministic` allows the chunked scheme in synchronous mode
    (which responses are cut depends on their lengths, not on timing), not the asynchronous engine (`determinism`)."""
    rl = cfg.rl_config
    split = rl.partial_rollout_max_split
    if split < 1:
        yield Problem(("rl_config.partial_rollout_max_split",),
                      f"rl_config.partial_rollout_max_split must be at least 1 (1: no partial rollout; N > 1: a "
                      f"response is generated over at most N iterations), got {split}")
        return
    if split == 1:
        return
    max_tokens = cfg.generate_config.sampling_config.max_tokens
    if max_tokens >= 1 and max_tokens % split != 0:
        lower, upper = max_tokens - max_tokens % split, max_tokens - max_tokens % split + split
        yield Problem(("rl_config.partial_rollout_max_split", "generate_config.sampling_config.max_tokens"),
                      f"rl_config.partial_rollout_max_split ({split}) must divide "
                      f"generate_config.sampling_config.max_tokens ({max_tokens}): each iteration generates "
                      f"max_tokens // {split} tokens of a response, as MindSpeed-RL asserts; set max_tokens to a "
                      f"multiple of {split} (e.g. {lower or upper}) or choose a split that divides {max_tokens}")
    for switched_on, key, what, fix in (
            (rl.multi_turn_enable, "rl_config.multi_turn_enable",
             "multi-turn rollouts (a response of several turns and tool answers)", "set multi_turn_enable: false"),
            (cfg.derived.dynamic_sampling, "rl_config.filter_groups_enable",
             "DAPO's dynamic sampling (groups filtered and generated again)", "set filter_groups_enable: false"),
            (cfg.derived.critic_trainer, "critic_config",
             "PPO's critic (stage: ray_ppo; values and GAE over each response)", "train GRPO or DAPO (no critic_config)"),
            (cfg.rlfabric.routing_replay != "none", "rlfabric.routing_replay",
             "routing replay (each continuation routes its context anew, so no one routing covers the response)",
             "set routing_replay: none")):
        if switched_on:
            yield Problem(("rl_config.partial_rollout_max_split", key),
                          f"rl_config.partial_rollout_max_split ({split}) asks for partial rollout with {what}, "
                          f"which rlfabric's partial rollout does not support; set partial_rollout_max_split: 1, "
                          f"or {fix}")
