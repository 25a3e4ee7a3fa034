"""The weights version: the label of the weights a sample was generated with, and every rule that reads it.

A version names one set of weights for the whole run, across restarts: it only moves forward, so a number that
was ever served never names other weights. The coordinator assigns the labels the replicas serve: at a run's
start one past every version anyone holds (`first_of_run`), then one more per update (`after_update`). The trainer
applies the same `after_update` rule to its own label between pushes, so that its Update fence agrees with the
coordinator's before the push; a push relabels its weights with the coordinator's number.

`AS_LOADED` (0) is the version of weights as loaded from disk; as an expected version it means "any".
"""

from __future__ import annotations

from collections.abc import Iterable

AS_LOADED = 0


def after_update(version: int) -> int:
    """The label of the weights one update (or checkpoint load) past those labelled `version`."""
    return version + 1


def first_of_run(*held: int) -> int:
    """The version a run (or a resumed attempt) starts with: one past every version journaled or held."""
    return max((AS_LOADED, *held)) + 1


def moves_forward(new: int, current: int) -> bool:
    """Whether weights labelled `current` may be relabelled `new` (a push of the same version again is fine)."""
    return new >= current


def serves(expected: int, held: int) -> bool:
    """Whether a replica holding `held` serves a request expecting `expected` (AS_LOADED: any version)."""
    return expected == AS_LOADED or expected == held


def outside_fence(sample_versions: Iterable[int], actor_version: int, max_staleness: int) -> list[int]:
    """The staleness fence: the sample versions (distinct, sorted) that are not 0..`max_staleness` versions behind
    an actor at `actor_version`; an update may train only on samples for which this is empty."""
    return sorted({int(v) for v in sample_versions if not 0 <= actor_version - int(v) <= max_staleness})


def staleness_bound(max_staleness: int, partial_rollout_max_split: int) -> int:
    """The most versions a trained token may lag the actor: the bound the staleness fence (the coordinator's, and
    the trainer's Update) holds every sample to.

    `max_staleness` is how many versions the rollout runs ahead of the update (`rlfabric.max_staleness`: 0
    synchronous, 1 pipelined). Partial rollout (`rl_config.partial_rollout_max_split` N > 1) adds N - 1: a response
    cut at a chunk is continued in a later iteration with newer weights, so a response finished at its N-th split
    has first tokens generated up to N - 1 iterations before its last. Without partial rollout (N = 1) the bound is
    `max_staleness`.
    """
    return max_staleness + partial_rollout_max_split - 1
