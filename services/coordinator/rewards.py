"""Phases 2 and 3 of an iteration: the final reward of every sample of the groups that train, and their advantages.

A sample's final reward is the verifiers' weighted sum the reward stream returned (0 for a sample that failed in
rollout), then DAPO's overlong shaping (`overlong_buffer_enable`); its advantage is `rl_config.adv_estimator`'s
over those rewards (advantages.py, its one home). A failed sample keeps its place in its group for the
normalisation and trains no tokens. `trained_batch_metrics`: the seed's score and length metrics of what trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.sequences import Sequences
from services.coordinator.advantages import apply_overlong_penalty, compute_advantages
from services.coordinator.generation import Group
from services.coordinator.iteration_metrics import batch_metrics
from services.coordinator.settings import IterationSettings
from services.coordinator.trainer_requests import sequences_of


@dataclass
class TrainBatch:
    """The groups an iteration trains on, flattened: samples in group order, their final rewards."""

    groups: list[Group]
    rewards: np.ndarray  # float64 [groups * n]
    seqs: Sequences  # the trainable samples

    @property
    def samples(self) -> list[Any]:
        return [x for g in self.groups for x in g.samples]


def score_groups(groups: list[Group], weights_version: int, settings: IterationSettings) -> TrainBatch:
    """Final rewards in group order: the verifiers' weighted sum (0 for a failed sample), then DAPO shaping. The
    trained batch's version is its oldest sample's (`weights_version` when it has none): partial rollout continues
    responses across versions."""
    s = settings
    samples = [x for g in groups for x in g.samples]
    rewards = np.array([r.reward if not x.error else 0.0 for g in groups for x, r in zip(g.samples, g.scores,
                                                                                         strict=True)])
    if s.overlong_buffer_enable:
        lengths = np.array([x.response_length for x in samples], dtype=np.int64)
        rewards = apply_overlong_penalty(rewards, lengths, s.rollout_max_tokens, s.overlong_buffer,
                                         s.overlong_buffer_penalty_factor)
    trainable = [(x, g.prompt.prompt) for g in groups for x in g.trainable()]
    oldest = min((int(x.weights_version) for x, _ in trainable), default=weights_version)
    seqs = sequences_of([x for x, _ in trainable], [p for _, p in trainable], oldest)
    return TrainBatch(groups, rewards, seqs)


def advantages_by_sample(batch: TrainBatch, settings: IterationSettings) -> dict[str, float]:
    """Each sample's advantage, by sample id (over the tokens each sample trains: none for a failed one)."""
    lengths = [0 if x.error else x.response_length for x in batch.samples]
    advantages = compute_advantages(settings.adv_estimator, batch.rewards, settings.n_samples_per_prompt, lengths,
                                    norm_adv_by_std=settings.norm_adv_by_std_in_grpo)
    return {x.sample_id: float(a) for x, a in zip(batch.samples, advantages, strict=True)}


def verifier_scores(groups: list[Group], verifiers: Sequence[tuple[str, float]]) -> dict[str, list[float]]:
    """Each verifier's unweighted score per sample, in group order (0 for a failed sample)."""
    return {name: [0.0 if x.error else r.scores[i].score for g in groups
                   for x, r in zip(g.samples, g.scores, strict=True)]
            for i, (name, _w) in enumerate(verifiers)}


def trained_batch_metrics(gen: Any, trained: TrainBatch, timings: dict[str, float], s: IterationSettings
                      ) -> dict[str, float]:
    """As MindSpeed-RL's DAPO trainer: scores and lengths over the trained samples, the verifiers' means
    and the generation throughputs over everything generated."""
    samples = trained.samples
    metrics = batch_metrics(
        rewards=trained.rewards, verifier_scores=verifier_scores(gen.generated, s.verifiers),
        prompt_lengths=[x.prompt_length for x in samples], response_lengths=[x.response_length for x in samples],
        global_batch_size=len(trained.groups), generated_prompts=len(gen.generated),
        n_samples_per_prompt=s.n_samples_per_prompt, world_size=s.world_size, timings=timings,
        log_max_throughput=s.log_max_throughput)
    # A sample fails in rollout (`Sample.error`) or in reward (an error on a verifier score: a timeout,
    # a crash, or no worker left to score it); either way its reward is not a verdict.
    metrics["failed_samples"] = float(sum(1 for g in gen.generated for x, r in zip(g.samples, g.scores, strict=True)
                                          if x.error or any(v.error for v in r.scores)))
    if s.filter_groups_enable:
        metrics.update({"train/num_gen_batches": float(len(gen.batches)),
                        "dapo/num_groups_generated": float(len(gen.generated)),
                        "dapo/num_groups_kept": float(gen.num_groups_kept),
                        "dapo/num_groups_trained": float(len(gen.trained))})
    return metrics
