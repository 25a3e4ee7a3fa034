"""Rules of the batch sizes: how global_batch_size x n_samples_per_prompt samples divide over the actor's
data-parallel ranks, micro-batches, mini-batches and rollout engines, and MindSpeed-RL's `*_dispatch_size` keys
(samples per worker call: each must divide the samples of an iteration, as upstream checks).

Gathered into validation.py's `RULES`, like the other topic modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig


def batch_divisibility(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, rl, d = cfg.actor_config, cfg.rl_config, cfg.derived
    gbs, micro, n, mini = a.global_batch_size, a.micro_batch_size, rl.n_samples_per_prompt, rl.mini_batch_size
    if None in (gbs, micro) or min(gbs, micro, n, mini) < 1:
        return
    samples = gbs * n
    if samples % micro != 0:
        yield Problem(("micro_batch_size", "global_batch_size", "rl_config.n_samples_per_prompt"),
                      f"global_batch_size x n_samples_per_prompt = {gbs} x {n} = {samples} samples must be "
                      f"divisible by micro_batch_size ({micro}); choose a micro_batch_size that divides {samples}")
    dp = d.actor_data_parallel_size
    if dp is not None:
        if gbs % dp != 0:
            yield Problem(("global_batch_size", "rl_config.actor_resource.num_npus"),
                          f"global_batch_size ({gbs}) must be divisible by the actor data-parallel size {dp} "
                          f"(= {d.actor_world_size} devices / {d.actor_model_parallel_size} model-parallel); "
                          f"use a multiple of {dp} prompts")
        elif (gbs // dp * n) % micro != 0:
            yield Problem(("micro_batch_size", "global_batch_size"),
                          f"each actor data-parallel rank gets global_batch_size / DP x n = {gbs} / {dp} x {n} = "
                          f"{gbs // dp * n} samples, which micro_batch_size ({micro}) does not divide")
    rdp = d.rollout_data_parallel_size
    if rdp is not None and gbs % rdp != 0:
        yield Problem(("global_batch_size", "generate_config.infer_tensor_parallel_size"),
                      f"global_batch_size ({gbs}) must be divisible by the rollout data-parallel size {rdp} "
                      f"(= {d.actor_world_size} devices / infer TP {cfg.generate_config.infer_tensor_parallel_size})")
    if gbs % mini != 0:
        yield Problem(("rl_config.mini_batch_size", "global_batch_size"),
                      f"global_batch_size ({gbs}) must be divisible by rl_config.mini_batch_size ({mini}), both "
                      f"in prompts; set mini_batch_size to a divisor of {gbs} (equal means one optimizer step)")
    elif dp is not None:
        mini_samples = mini * n
        if mini_samples % dp != 0:
            yield Problem(("rl_config.mini_batch_size", "rl_config.actor_resource.num_npus"),
                          f"a mini-batch of mini_batch_size x n = {mini} x {n} = {mini_samples} samples must be "
                          f"divisible by the actor data-parallel size {dp}")
        elif (mini_samples // dp) % micro != 0:
            yield Problem(("micro_batch_size", "rl_config.mini_batch_size"),
                          f"each rank's share of a mini-batch, mini_batch_size x n / DP = {mini} x {n} / {dp} = "
                          f"{mini_samples // dp} samples, must be divisible by micro_batch_size ({micro})")


def dispatch_sizes(cfg: RLFabricConfig) -> Iterable[Problem]:
    a, rl, d = cfg.actor_config, cfg.rl_config, cfg.derived
    if a.global_batch_size is None or d.samples_per_iteration is None:
        return
    samples = d.samples_per_iteration
    for name in ("actor_rollout_dispatch_size", "actor_logprob_dispatch_size", "ref_dispatch_size",
                 "reward_dispatch_size", "adv_dispatch_size", "actor_update_dispatch_size"):
        size = getattr(rl, name)
        if size is None:
            continue
        if size < 1 or samples % size != 0:
            yield Problem((f"rl_config.{name}",),
                          f"rl_config.{name} ({size}) must divide the samples per iteration, global_batch_size x n "
                          f"= {samples}; remove it to use the computed value")
    upd, dp = rl.actor_update_dispatch_size, d.actor_data_parallel_size
    if upd is not None and dp is not None and d.mini_batch_size_samples is not None \
            and upd * dp < d.mini_batch_size_samples:
        yield Problem(("rl_config.actor_update_dispatch_size",),
                      f"rl_config.actor_update_dispatch_size ({upd}) must be at least mini_batch_size x n / DP = "
                      f"{d.mini_batch_size_samples} / {dp} = {d.mini_batch_size_samples // dp}")
