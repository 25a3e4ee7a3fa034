"""PPO's steps between the rollout and the actor's update (`stage: ray_ppo`), in MindSpeed-RL's order
(ppo_trainer_hybrid.py `fit`): the critic's values of the trained samples, the rule score on each response's last
token, GAE advantages and returns (services/coordinator/gae.py), the critic's update on those returns, then the
actor's update on the per-token advantages (iteration.py), and the metrics upstream logs (`critic/*`).

Everything here is keyed by sample id, over the trainable samples of the batch (a failed sample trains no token,
so it gets no values, advantages or returns); the batch's tokens are one matrix only inside `gae_targets`, where the
whitening runs over all of them together, as upstream's does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from rlfabric.v1 import trainer_pb2
from services.common.kl import kl_penalty
from services.common.sequences import Sequences, split_response_values
from services.common.tensors import to_numpy, to_proto
from services.coordinator.errors import IterationError
from services.coordinator.gae import apply_kl_in_reward, gae_advantages_and_returns, token_level_scores
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.rewards import TrainBatch
from services.coordinator.settings import IterationSettings


@dataclass
class GaeTargets:
    """Per-token advantages and returns by sample id (float32, each sample's response length), and their metrics."""

    advantages: dict[str, np.ndarray]
    returns: dict[str, np.ndarray]
    metrics: dict[str, float]


def compute_values(critic: Any, seqs: Sequences, micro: int, settings: IterationSettings,
                   clock: PhaseClock) -> dict[str, np.ndarray]:
    """The critic's value of each response token's state, by sample id, `micro` rows per request (timed as
    `critic_model`, MindSpeed-RL's name for the pass)."""
    requests = [trainer_pb2.ValueRequest(batch=seqs.take(i, i + micro).to_proto()) for i in range(0, len(seqs), micro)]
    lengths = dict(zip(seqs.sample_ids, seqs.response_lengths.tolist(), strict=True))
    out: dict[str, np.ndarray] = {}
    start = time.perf_counter()
    try:
        for reply in critic.ComputeValues(iter(requests), timeout=settings.deadline_s):
            ids = list(reply.sample_ids)
            out.update(zip(ids, split_response_values(to_numpy(reply.values), [lengths[x] for x in ids]), strict=True))
    except grpc.RpcError as e:
        raise IterationError(f"critic ComputeValues: {e.code().name}: {e.details()}") from e
    clock.record("critic_model", start, time.perf_counter())
    return out


def gae_targets(batch: TrainBatch, values: dict[str, np.ndarray], settings: IterationSettings,
                kl_in_reward: tuple[dict[str, np.ndarray], dict[str, np.ndarray], float] | None = None) -> GaeTargets:
    """GAE over the trainable samples of `batch`: the score on each response's last token, the critic's `values`.

    `kl_in_reward`: (old log-probs, reference log-probs, coefficient) with `use_kl_in_reward`: each token's reward
    loses coefficient x the `kl_penalty` estimate, and the metrics carry the batch's KL (`actor/reward_kl_penalty`,
    what the KL controller is updated with) and the coefficient (`actor/reward_kl_penalty_coeff`), verl's names.
    """
    seqs = batch.seqs
    ids, lengths = list(seqs.sample_ids), seqs.response_lengths.astype(np.int64)
    if not ids:
        return GaeTargets({}, {}, {})
    reward_of = {x.sample_id: float(r) for x, r in zip(batch.samples, batch.rewards, strict=True)}
    width = int(lengths.max())
    scores = token_level_scores([reward_of[x] for x in ids], lengths, width)
    missing = [x for x in ids if x not in values]
    if missing:
        raise IterationError(f"critic: no values for {len(missing)} samples (first: {missing[:3]})")
    vals = _padded([values[x] for x in ids], width)
    masks = (split_response_values(seqs.response_mask, lengths.tolist()) if seqs.response_mask is not None
             else [np.ones(n, np.bool_) for n in lengths])
    mask = _padded(masks, width).astype(bool)
    rewards, kl_metrics = scores, {}
    if kl_in_reward is not None:
        old_lp, ref_lp, coef = kl_in_reward
        old, ref = _padded([old_lp[x] for x in ids], width), _padded([ref_lp[x] for x in ids], width)
        kl = kl_penalty(torch.from_numpy(old), torch.from_numpy(ref), settings.kl_penalty).numpy()
        rewards, current_kl = apply_kl_in_reward(scores, kl, lengths, coef)
        kl_metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": coef}
    advantages, returns = gae_advantages_and_returns(rewards, vals, mask, settings.gamma, settings.lam)
    adv_of = {x: advantages[i, :n].astype(np.float32) for i, (x, n) in enumerate(zip(ids, lengths, strict=True))}
    ret_of = {x: returns[i, :n].astype(np.float32) for i, (x, n) in enumerate(zip(ids, lengths, strict=True))}
    return GaeTargets(adv_of, ret_of, {**ppo_data_metrics(scores.sum(axis=1), advantages, returns, vals, mask),
                                       **kl_metrics})


def ppo_data_metrics(sequence_scores: np.ndarray, advantages: np.ndarray, returns: np.ndarray, values: np.ndarray,
                     mask: np.ndarray) -> dict[str, float]:
    """MindSpeed-RL's `compute_ppo_data_metrics` names: `critic/score/*` over the samples, `critic/advantages/*`,
    `critic/returns/*` and `critic/values/*` over the response tokens that train."""
    out = {"critic/score/mean": float(np.mean(sequence_scores)), "critic/score/max": float(np.max(sequence_scores)),
           "critic/score/min": float(np.min(sequence_scores))}
    for name, matrix in (("advantages", advantages), ("returns", returns), ("values", values)):
        picked = matrix[mask]
        out.update({f"critic/{name}/mean": float(picked.mean()), f"critic/{name}/max": float(picked.max()),
                    f"critic/{name}/min": float(picked.min())})
    return out


def critic_update_requests(seqs: Sequences, targets: GaeTargets, values: dict[str, np.ndarray], *, step: int,
                           chunk: int) -> list[trainer_pb2.UpdateRequest]:
    """The critic's `Update` over the trained samples: GAE's returns, and the values it gave them (the clip's
    anchor), `chunk` rows per request."""
    requests = []
    for i in range(0, len(seqs), chunk):
        part = seqs.take(i, i + chunk)
        ids = part.sample_ids
        requests.append(trainer_pb2.UpdateRequest(
            batch=part.to_proto(), step=step,
            returns=to_proto(_flat([targets.returns[x] for x in ids])),
            values=to_proto(_flat([values[x] for x in ids]))))
    return requests


def update_critic(critic: Any, seqs: Sequences, targets: GaeTargets, values: dict[str, np.ndarray], *, step: int,
                  settings: IterationSettings, clock: PhaseClock) -> dict[str, float]:
    """The critic's update (timed as `update_critic`); returns its metrics (`critic/*`)."""
    if not len(seqs):
        return {}
    requests = critic_update_requests(seqs, targets, values, step=step, chunk=settings.update_chunk_size)
    start = time.perf_counter()
    try:
        reply = critic.Update(iter(requests), timeout=settings.deadline_s)
    except grpc.RpcError as e:
        raise IterationError(f"critic Update: {e.code().name}: {e.details()}") from e
    clock.record("update_critic", start, time.perf_counter())
    return dict(reply.metrics.values)


def _padded(rows: Sequence[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _flat(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def critic_phases(critic: Any, kl_controller: Any, trained: TrainBatch, iteration: int, clock: PhaseClock,
                  old_lp: dict[str, np.ndarray], ref_lp: dict[str, np.ndarray],
                  settings: IterationSettings) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The critic's values of the trained samples, GAE (with the KL in the reward, if asked: `kl_controller` gives its
    coefficient and learns from it), then the critic's update on GAE's returns. Returns the actor's per-token
    advantages by sample id, and the metrics."""
    s, seqs = settings, trained.seqs
    values = compute_values(critic, seqs, s.critic_forward_micro_batch_size, s, clock) if len(seqs) else {}
    start = time.perf_counter()
    kl = (old_lp, ref_lp, kl_controller.value) if s.use_kl_in_reward else None
    targets = gae_targets(trained, values, s, kl)
    if kl is not None and len(seqs):
        kl_controller.update(targets.metrics["actor/reward_kl_penalty"], len(seqs))
    clock.record("adv", start, time.perf_counter())
    metrics = update_critic(critic, seqs, targets, values, step=iteration, settings=s, clock=clock)
    return targets.advantages, {**targets.metrics, **metrics}
