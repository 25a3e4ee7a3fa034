"""One GRPO iteration as the coordinator runs it, over the services' gRPC stubs.

`GrpoIteration.run` reads as its phases (see docs/architecture.md, "One GRPO iteration"):
1. generate + stream: prompt groups go to the rollout replicas holding `weights_version`; as samples stream
   back they are scored and, in micro-batches, sent to the reference trainer (`generation.py`);
2. score: final rewards (verifier sum, DAPO overlong shaping);
3. reference: the reference log-probs streamed during the rollout;
4. old log-probs: the actor's, skipped when fully on-policy;
5. advantages: group normalisation;
6. update: the actor's `Update` over the whole batch;
7. sync: the actor pushes the new version to every replica, which acks it with a checksum;
8. metrics: the seed's table.

A sample that fails (for example a prompt longer than `max_model_len`) costs that sample: it scores 0,
keeps its place in its group for the normalisation, and contributes no tokens to the update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import reward_pb2, trainer_pb2
from services.common.sequences import Sequences
from services.common.tensors import to_proto
from services.coordinator.advantages import (
    apply_overlong_penalty,
    compute_group_advantages,
    make_kl_controller,
)
from services.coordinator.errors import IterationError
from services.coordinator.generation import (
    Generator,
    Group,
    GroupPrompt,
    LogProbStream,
    collect_log_probs,
    sequences_of,
)
from services.coordinator.iteration_metrics import PhaseClock, batch_metrics, timing_metrics
from services.coordinator.settings import IterationSettings
from services.coordinator.weight_sync import Replica, WeightSync

logger = logging.getLogger(__name__)


@dataclass
class IterationResult:
    metrics: dict[str, float]
    weights_version: int


@dataclass
class _Batch:
    """The groups an iteration trains on, flattened: samples in group order, their final rewards."""

    groups: list[Group]
    rewards: np.ndarray  # float64 [groups * n]
    seqs: Sequences  # the trainable samples

    @property
    def samples(self) -> list[Any]:
        return [x for g in self.groups for x in g.samples]


class GrpoIteration:
    """Runs GRPO iterations against live services.

    Args:
        replicas: rollout replicas.
        score: the reward stream, `Reward.Score` of a worker or the coordinator's reward pool.
        actor: the actor trainer stub.
        reference: the reference trainer stub (None when no KL term is used).
        decode: token ids -> text without special tokens (the tokenizer of the run).
        settings: see IterationSettings.
        weight_sync: pushes the updated weights to the replicas.
    """

    def __init__(self, replicas: Sequence[Replica],
                 score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[reward_pb2.ScoreResponse]],
                 actor: Any, reference: Any | None, decode: Callable[[Sequence[int]], str],
                 settings: IterationSettings, weight_sync: WeightSync) -> None:
        if settings.use_reference and reference is None:
            raise ValueError("a KL term needs a reference trainer")
        self.generator = Generator(replicas, score, decode, settings)
        self.actor = actor
        self.reference = reference
        self.decode = decode
        self.settings = settings
        self.weight_sync = weight_sync
        self.kl_controller = make_kl_controller(settings.kl_ctrl_type, settings.init_kl_coef, settings.kl_target,
                                                settings.kl_horizon)

    def run(self, batch: Any, iteration: int, weights_version: int) -> IterationResult:
        """Runs iteration `iteration` on the loader's `batch` with the replicas at `weights_version`."""
        clock = PhaseClock()
        t0 = time.perf_counter()
        prompts = self._group_prompts(batch, iteration)
        ref_stream = self._reference_stream(clock)
        try:
            groups = self.generator.generate(prompts, weights_version, clock, ref_stream)
        finally:
            if ref_stream is not None:
                ref_stream.close()
        trained = self._score(groups, weights_version)
        ref_lp = ref_stream.join() if ref_stream is not None else {}
        old_lp = self._old_log_probs(trained.seqs, clock)
        adv_of = self._advantages(trained, clock)
        actor_metrics = self._update(trained.seqs, adv_of, old_lp, ref_lp, iteration, clock)
        new_version = self._sync(weights_version + 1, clock)
        timings = timing_metrics(clock, t0, time.perf_counter())
        return IterationResult({**timings, **actor_metrics, **self._metrics(trained, timings)}, new_version)

    # -- phases, in order ---------------------------------------------------------------------------------

    def _group_prompts(self, batch: Any, iteration: int) -> list[GroupPrompt]:
        labels = batch.labels if batch.labels is not None else [None] * len(batch.prompts)
        return [GroupPrompt(f"it{iteration}/p{int(pid)}", np.asarray(p, np.int32),
                            self.decode(lab.tolist()) if lab is not None else "")
                for pid, p, lab in zip(batch.prompt_indices, batch.prompts, labels, strict=True)]

    def _reference_stream(self, clock: PhaseClock) -> LogProbStream | None:
        if not self.settings.use_reference:
            return None
        return LogProbStream("reference_model", self.reference, self.settings,
                             self.settings.ref_forward_micro_batch_size, clock)

    def _score(self, groups: list[Group], weights_version: int) -> _Batch:
        """Final rewards in group order: the verifiers' weighted sum (0 for a failed sample), then DAPO shaping."""
        s = self.settings
        samples = [x for g in groups for x in g.samples]
        rewards = np.array([r.reward if not x.error else 0.0 for g in groups for x, r in zip(g.samples, g.scores,
                                                                                             strict=True)])
        if s.overlong_buffer_enable:
            lengths = np.array([x.response_length for x in samples], dtype=np.int64)
            rewards = apply_overlong_penalty(rewards, lengths, s.rollout_max_tokens, s.overlong_buffer,
                                             s.overlong_buffer_penalty_factor)
        trainable = [(x, g.prompt.prompt) for g in groups for x in g.trainable()]
        seqs = sequences_of([x for x, _ in trainable], [p for _, p in trainable], weights_version)
        return _Batch(groups, rewards, seqs)

    def _old_log_probs(self, seqs: Sequences, clock: PhaseClock) -> dict[str, np.ndarray]:
        if self.settings.skip_old_log_probs or not len(seqs):
            return {}
        start = time.perf_counter()
        out = self._log_probs(self.actor, seqs, self.settings.actor_forward_micro_batch_size)
        clock.record("old_log_p", start, time.perf_counter())
        return out

    def _advantages(self, trained: _Batch, clock: PhaseClock) -> dict[str, float]:
        start = time.perf_counter()
        advantages = compute_group_advantages(trained.rewards, self.settings.n_samples_per_prompt)
        adv_of = {x.sample_id: float(a) for x, a in zip(trained.samples, advantages, strict=True)}
        clock.record("adv", start, time.perf_counter())
        return adv_of

    def _update(self, seqs: Sequences, adv_of: dict[str, float], old_lp: dict[str, np.ndarray],
                ref_lp: dict[str, np.ndarray], iteration: int, clock: PhaseClock) -> dict[str, float]:
        if not len(seqs):
            return {}
        s = self.settings
        kl_coef = self.kl_controller.value if s.use_reference else 0.0
        requests = [self._update_request(seqs.take(i, i + s.update_chunk_size), adv_of, old_lp, ref_lp, iteration,
                                         kl_coef) for i in range(0, len(seqs), s.update_chunk_size)]
        start = time.perf_counter()
        try:
            reply = self.actor.Update(iter(requests), timeout=s.deadline_s)
        except grpc.RpcError as e:
            raise IterationError(f"actor Update: {e.code().name}: {e.details()}") from e
        clock.record("update", start, time.perf_counter())
        metrics = dict(reply.metrics.values)
        if s.use_reference:
            metrics["actor/kl_coef"] = kl_coef
            self.kl_controller.update(metrics.get("actor/kl_loss", 0.0), len(seqs))
        return metrics

    def _sync(self, new_version: int, clock: PhaseClock) -> int:
        start = time.perf_counter()
        self.weight_sync.push(new_version)
        clock.record("resharding_to_infer", start, time.perf_counter())
        return new_version

    def _metrics(self, trained: _Batch, timings: dict[str, float]) -> dict[str, float]:
        s = self.settings
        samples = trained.samples
        verifier_scores = {name: [0.0 if x.error else r.scores[i].score for g in trained.groups
                                  for x, r in zip(g.samples, g.scores, strict=True)]
                           for i, (name, _w) in enumerate(s.verifiers)}
        metrics = batch_metrics(
            rewards=trained.rewards, verifier_scores=verifier_scores,
            prompt_lengths=[x.prompt_length for x in samples], response_lengths=[x.response_length for x in samples],
            global_batch_size=len(trained.groups), n_samples_per_prompt=s.n_samples_per_prompt,
            world_size=s.world_size, timings=timings, log_max_throughput=s.log_max_throughput)
        metrics["failed_samples"] = float(sum(1 for x in samples if x.error))
        return metrics

    # -- helpers ------------------------------------------------------------------------------------------

    def _update_request(self, chunk: Sequences, adv_of: dict[str, float], old_lp: dict[str, np.ndarray],
                        ref_lp: dict[str, np.ndarray], iteration: int, kl_coef: float) -> trainer_pb2.UpdateRequest:
        ids = chunk.sample_ids
        req = trainer_pb2.UpdateRequest(
            batch=chunk.to_proto(), advantages=to_proto(np.array([adv_of[x] for x in ids], dtype=np.float32)),
            temperature=self.settings.temperature, step=iteration, kl_coef=kl_coef)
        if old_lp:
            req.old_log_probs.CopyFrom(to_proto(np.concatenate([old_lp[x] for x in ids]).astype(np.float32)))
        if self.settings.use_reference:
            missing = [x for x in ids if x not in ref_lp]
            if missing:
                raise IterationError(f"reference: no log-probs for {len(missing)} samples (first: {missing[:3]})")
            req.ref_log_probs.CopyFrom(to_proto(np.concatenate([ref_lp[x] for x in ids]).astype(np.float32)))
        return req

    def _log_probs(self, stub: Any, seqs: Sequences, micro: int) -> dict[str, np.ndarray]:
        requests = [trainer_pb2.LogProbRequest(batch=seqs.take(i, i + micro).to_proto(),
                                               temperature=self.settings.temperature)
                    for i in range(0, len(seqs), micro)]
        lengths = dict(zip(seqs.sample_ids, seqs.response_lengths.tolist(), strict=True))
        out: dict[str, np.ndarray] = {}
        try:
            for reply in stub.ComputeLogProbs(iter(requests), timeout=self.settings.deadline_s):
                collect_log_probs(reply, lengths, out)
        except grpc.RpcError as e:
            raise IterationError(f"ComputeLogProbs: {e.code().name}: {e.details()}") from e
        return out
