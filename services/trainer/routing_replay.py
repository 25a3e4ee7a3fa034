"""Routing replay: a forward whose MoE routers use given experts (the rollout's) instead of their own top-k.

The rollout engine reports, for every token it computed, the experts each MoE layer chose
(services/rollout/routed_experts.py). Replaying them in the trainer's old-log-prob, reference and update
passes removes one source of the rollout/training log-prob mismatch: a token whose router scores are near a
tie may pick other experts in the trainer's precision or kernels, and then its log-prob differs by far more
than rounding.

How: Megatron's top-k routing asks the router's `router_replay` object for the top-k whenever one is set
(`topk_routing_with_score_function(router_replay=...)`), with the router's scores and its own top-k function.
`ReplayedRouting` takes that place on every router of the model: it returns the given experts, their
probabilities gathered from the router's scores as Megatron's own replay does (so the gradient still flows
to the router through the chosen experts' scores), and the router's own choice on free rows (-1: positions
whose output predicts no response token, padding). Megatron's RouterReplay registers every instance in a
process-wide list and replays in that order; one object per router, keyed by its layer, avoids both.

Token order: a router sees its stage's hidden states [S, b, h] flattened sequence-first (and, with sequence
parallelism, this TP rank's contiguous share of S), so a micro-batch's [b, S, layers, k] targets are
transposed and sliced the same way. The targets stay set until the next micro-batch: at PP 1 Megatron runs a
micro-batch's backward (and any recompute in it) before the next forward; under PP recompute is refused
(services/common/config/routing_replay.py).
"""

from __future__ import annotations

import torch


class ReplayedRouting:
    """Stands in for a router's `router_replay`: the top-k from the targets, the router's own on free rows."""

    def __init__(self, column: int) -> None:
        self.column = column  # this router's MoE layer among the model's MoE layers (0-based, layer order)
        self.target: torch.Tensor | None = None  # int64 [tokens, top_k]; a row of -1 is free
        # Tokens replayed, and among them those whose own top-k was another set of experts (since the last take);
        # kept as a tensor on the scores' device so that counting never waits for the device.
        self.counts: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return own_values, own
        target = self.target.to(scores.device)
        if target.shape != own.shape:
            raise ValueError(f"routing replay: MoE layer {self.column} got targets of shape {tuple(target.shape)} "
                             f"for {tuple(own.shape)} routed tokens")
        free = (target < 0).any(-1, keepdim=True)
        chosen = torch.where(free, own, target)
        with torch.no_grad():
            given = ~free.squeeze(-1)
            differs = (own.sort(-1).values != target.sort(-1).values).any(-1) & given
            step = torch.stack([given.sum(), differs.sum()]).double()
            self.counts = step if self.counts is None else self.counts + step
        return scores.gather(1, chosen), chosen


def _routers(model) -> list:
    from services.trainer.moe import routers

    return routers(model)


def _moe_columns(config) -> dict[int, int]:
    """Global layer index (0-based) -> column among the model's MoE layers."""
    freq = config.moe_layer_freq
    pattern = list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    moe_layers = [i for i, is_moe in enumerate(pattern) if is_moe]
    return {layer: column for column, layer in enumerate(moe_layers)}


def set_targets(model, micro_batch: dict) -> None:
    """Replays `micro_batch["routed_experts"]` ([b, S, layers, k], -1 free) in the next forward; none: own routing."""
    routed = micro_batch.get("routed_experts")
    found = _routers(model)
    if routed is None or not found:  # no replay, or a pipeline stage without MoE layers
        clear(model)
        return
    if not isinstance(found[0].router_replay, ReplayedRouting):
        columns = _moe_columns(found[0].config)
        for router in found:
            router.router_replay = ReplayedRouting(columns[int(router.layer_number) - 1])
    seq_first = routed.transpose(0, 1)  # [S, b, layers, k], the routers' token order
    if found[0].config.sequence_parallel:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        share = seq_first.shape[0] // tp
        seq_first = seq_first[rank * share:(rank + 1) * share]
    for router in found:
        router.router_replay.target = seq_first[:, :, router.router_replay.column].reshape(
            -1, seq_first.shape[-1]).long()


def take_metrics(model) -> dict[str, float]:
    """`moe/routing_replay_changed_fraction`: of the (token, MoE layer) routings replayed since the last call, the
    share where the trainer's own router would have chosen other experts (a collective over the whole group;
    every rank calls it after a pass with replay). Counted in every forward of the pass, recomputes included."""
    import torch.distributed as dist

    counts = torch.zeros(2, dtype=torch.float64)
    for router in _routers(model):
        replay = router.router_replay
        if isinstance(replay, ReplayedRouting) and replay.counts is not None:
            counts += replay.counts.cpu()
            replay.counts = None
    if dist.is_initialized():
        from services.trainer.moe import comm_device

        counts = counts.to(comm_device())
        dist.all_reduce(counts)
    replayed, changed = counts.tolist()
    return {"moe/routing_replay_changed_fraction": changed / replayed} if replayed else {}


def clear(model) -> None:
    """Back to the routers' own top-k (after a pass)."""
    for router in _routers(model):
        if isinstance(router.router_replay, ReplayedRouting):
            router.router_replay.target = None
