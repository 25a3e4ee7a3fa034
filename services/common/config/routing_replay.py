"""Rules of `rlfabric.routing_replay: rollout` (MoE routing replay: the trainer uses the rollout's experts).

- A MoE model: replay sets the experts of every MoE layer; a dense model has none to set.
- `generate_config.enable_prefix_caching` off: a prompt block served from the prefix cache is never computed,
  so the engine has no routing to report for it (services/rollout/routed_experts.py).
- No activation recompute under pipeline parallelism: a recomputed MoE layer routes again in backward, and
  Megatron's 1F1B schedule runs other micro-batches' forwards between a micro-batch's forward and its
  backward, so the replayed choices set for the forward would not be the ones in place for the recompute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig

KEY = "routing_replay"


def routing_replay_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    if cfg.rlfabric.routing_replay != "rollout":
        return
    where = cfg.where(KEY)
    if cfg.actor_config.num_experts is None:
        yield Problem((KEY,), f"{where}: rollout replays the experts of MoE layers, but the model has none "
                              f"(num_experts unset: a dense model); set it to none")
    if cfg.generate_config.enable_prefix_caching:
        yield Problem((KEY, "enable_prefix_caching"),
                      f"{where}: rollout needs generate_config.enable_prefix_caching false: prompt blocks served "
                      f"from the prefix cache are never computed, so their routing is unknown")
    for prefix, mt in (("", cfg.actor_config), ("ref_config.", cfg.ref_config)):
        if mt.pipeline_model_parallel_size > 1 and mt.recompute_granularity is not None:
            yield Problem((KEY, f"{prefix}recompute_granularity"),
                          f"{where}: rollout is not supported with {prefix}recompute_granularity under pipeline "
                          f"parallelism ({prefix}pipeline_model_parallel_size "
                          f"{mt.pipeline_model_parallel_size}): a recomputed MoE layer would route again in "
                          f"backward without the replayed experts; unset recompute_granularity or use PP 1")
