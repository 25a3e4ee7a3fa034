"""Off-policy facts of a batch: the version fence, the behaviour log-probs, and how far the rollout's log-probs
are from the trainer's (`rollout_mismatch`, every mode).

With `rlfabric.max_staleness: 1` the rollout generates iteration k+1 with the weights of k-1 while the actor
updates on k (`GrpoIteration.run_overlapped`), so the samples an update trains on may be one weight version
behind the actor; with partial rollout (`rl_config.partial_rollout_max_split: N`, partial_rollout.py) a
continued response's first tokens may be up to N - 1 more. The fence refuses any sample outside that bound
(weight_version.staleness_bound; the trainer's Update checks the same bound). The rollout's own log-probs of the sampled tokens travel with the batch in pipelined mode,
and in every mode with a rollout correction (`rlfabric.rollout_is` / `rollout_rs`), so that the trainer can weight
each token by the truncated importance ratio and drop the ones past its thresholds
(services/trainer/rollout_correction.py). `rollout_mismatch/*` is measured here against the old-log-prob pass when
it runs; when it is skipped, the log-probs travel in every mode and the trainer measures it against its own current
log-probs (without a correction they leave the loss as it is).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.tensors import to_numpy
from services.common.weight_version import outside_fence
from services.coordinator.errors import IterationError
from services.coordinator.generation import Group


def fence(groups: Sequence[Group], actor_version: int, bound: int) -> dict[str, float]:
    """Checks that every trainable sample is 0..`bound` versions behind the actor (at `actor_version`); a sample's
    version is its oldest token's (partial rollout continues a response across versions).

    Returns, in weight versions: `staleness/mean` and `staleness/max` over the trainable samples, and
    `staleness/token_mean` over their response tokens (each token's own version under partial rollout).
    Raises IterationError naming the versions when one is outside the bound.
    """
    trainable = [x for g in groups for x in g.trainable()]
    versions = [int(x.weights_version) for x in trainable]
    lags = np.array([actor_version - v for v in versions], dtype=np.float64)
    if outside_fence(versions, actor_version, bound):
        raise IterationError(f"version fence: samples {int(lags.min())}..{int(lags.max())} versions behind the actor "
                             f"(version {actor_version}); rlfabric.max_staleness and "
                             f"rl_config.partial_rollout_max_split allow 0..{bound}")
    token_lags = [actor_version - (to_numpy(x.response_token_versions).astype(np.float64).reshape(-1)
                                   if x.HasField("response_token_versions")
                                   else np.full(x.response_length, float(x.weights_version)))
                  for x in trainable]
    tokens = np.concatenate(token_lags) if token_lags else np.zeros(0)
    return {"staleness/mean": float(lags.mean()) if lags.size else 0.0,
            "staleness/max": float(lags.max()) if lags.size else 0.0,
            "staleness/token_mean": float(tokens.mean()) if tokens.size else 0.0}


def behavior_log_probs(groups: Sequence[Group], *, required: bool = True) -> dict[str, np.ndarray]:
    """The rollout's log-probs of each trainable sample's tokens (the behaviour policy), by sample id.

    `required` False (they only measure the mismatch): {} when a sample lacks them, rather than an error.
    """
    out = {}
    for x in (x for g in groups for x in g.trainable()):
        lp = to_numpy(x.response_log_probs).astype(np.float32).reshape(-1)
        if lp.shape[0] != x.response_length:
            if not required:
                return {}
            raise IterationError(f"rollout: sample {x.sample_id} has {lp.shape[0]} log-probs for {x.response_length} "
                                 "tokens; pipelined mode and the rollout correction need the log-prob of every "
                                 "sampled token")
        out[x.sample_id] = lp
    return out


def rollout_mismatch(groups: Sequence[Group], trainer_log_probs: dict[str, np.ndarray],
                     actor_version: int) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's at the same weights.

    Over every response token of the trainable samples generated at `actor_version` (the weights the trainer's
    old-log-prob pass used; older samples differ by an update, not by the engines), with d = log p_trainer -
    log p_rollout: `rollout_mismatch/mean_abs_logp_diff` is mean |d|, `rollout_mismatch/max_ratio` the largest
    importance ratio exp(d), and `rollout_mismatch/kl` the k3 estimate of KL(rollout || trainer) on the
    rollout's own samples, mean(exp(d) - 1 - d) (non-negative, zero only when they agree). Kernels, precision
    and (for MoE) routing make them differ; routing replay is meant to shrink it.
    Empty when there is no such token or no trainer log-prob (old-log-prob pass skipped).
    """
    diffs = []
    for x in (x for g in groups for x in g.trainable()):
        trainer = trainer_log_probs.get(x.sample_id)
        if trainer is None or int(x.weights_version) != actor_version:
            continue
        rollout = to_numpy(x.response_log_probs).astype(np.float64).reshape(-1)
        if rollout.shape[0] == trainer.shape[0]:
            d = trainer.astype(np.float64) - rollout
            # multi-turn: tool answers were not sampled (their rollout log-probs are 0), so they leave the measure
            diffs.append(d[to_numpy(x.response_mask).astype(bool).reshape(-1)] if x.HasField("response_mask") else d)
    if not diffs:
        return {}
    d = np.concatenate(diffs)
    return {"rollout_mismatch/mean_abs_logp_diff": float(np.abs(d).mean()),
            "rollout_mismatch/max_ratio": float(np.exp(d.max())),
            "rollout_mismatch/kl": float(np.mean(np.expm1(d) - d))}
