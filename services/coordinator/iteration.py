"""One GRPO iteration as the coordinator runs it, over the services' gRPC stubs.

`GrpoIteration.run` reads as its phases (see docs/architecture.md, "One GRPO iteration"):
1. generate + stream: prompt groups go to the rollout replicas holding `weights_version`; as samples stream
   back they are scored and, on devices of its own, sent in micro-batches to the reference trainer
   (`generation.py`). With DAPO dynamic sampling (`filter_groups_enable`) further prompt batches are generated
   until `filter_groups_train_batch_size` groups with a spread in `filter_groups_metric` are kept
   (`dynamic_sampling.py`); only those train;
2. score: final rewards (the verifiers' weighted sum, DAPO overlong shaping; `rewards.py`);
3. advantages: group normalisation, or `rl_config.adv_estimator`'s (before the log-prob passes, as MindSpeed-RL
   orders them; `rewards.py`);
4. reference and old log-probs: the reference's (streamed during the rollout, or one pass: integrated mode onloads
   its weights around it) and the actor's (skipped when fully on-policy); PPO (`stage: ray_ppo`) computes its
   advantages here instead: the critic's values, GAE, the critic's update (`ppo.py`), in upstream's order;
5. update: the actor's `Update` over the trained batch (requests built by `trainer_requests.py`);
6. sync: the actor pushes the new version to every replica, which acks it with a checksum;
7. metrics: the seed's table, the iteration timeline, DAPO's counts.
In integrated mode (`use_integrated_worker`) `placement.py` moves the services' memory between the phases.
Partial rollout (`partial_rollout_max_split` > 1): phase 1 runs rounds over a pool that outlives it. Pipelined
(`rlfabric.max_staleness` N >= 1, `run_overlapped`): phase 1 of k+1 (..k+N) runs on the replicas' current weights
while phases 2-5 of k run; phase 6 waits for the update of k and the last sample generated (not its scores or
reference log-probs, which go on beside the push): k trains on samples up to N versions behind the actor (fenced,
and importance-weighted in the loss: `off_policy.py`).

A failing sample (say, a prompt over `max_model_len`) costs that sample: it scores 0, keeps its place in its
group for the normalisation, and trains no tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import reward_pb2
from services.common.sequences import Sequences
from services.common.weight_version import after_update
from services.coordinator.advantages import make_kl_controller
from services.coordinator.dynamic_sampling import (
    DynamicSamplingExhaustedError,
    GroupAccumulator,
    select_metric,
)
from services.coordinator.errors import IterationError
from services.coordinator.generation import Generator, Group, GroupPrompt
from services.coordinator.iteration_metrics import (
    PhaseClock,
    coordinator_time,
    timeline_metrics,
    timing_metrics,
)
from services.coordinator.log_prob_stream import KnownLogProbs, LogProbStream, requests_as_log_probs_arrive
from services.coordinator.multi_turn import MultiTurn
from services.coordinator.off_policy import behavior_log_probs, fence, rollout_mismatch
from services.coordinator.partial_rollout import PartialRollouts, partial_rollout
from services.coordinator.placement import Placement
from services.coordinator.rewards import (
    TrainBatch,
    advantages_by_sample,
    score_groups,
    trained_batch_metrics,
    verifier_scores,
)
from services.coordinator.settings import IterationSettings
from services.coordinator.trainer_requests import compute_log_probs, update_request
from services.coordinator.weight_sync import Replica

logger = logging.getLogger(__name__)


@dataclass
class IterationResult:
    """What an iteration did: its metrics, the version the replicas serve next, what it consumed and trained."""

    metrics: dict[str, float]
    weights_version: int
    batches: list[Any]  # the loader's PromptBatch objects this iteration consumed, in order
    trained_groups: list[str]  # group ids, in training order


@dataclass
class _Generated:
    """The generation phase's outcome: every group generated, and the ones that train."""

    generated: list[Group]
    trained: list[Group]
    batches: list[Any]
    num_groups_kept: int  # groups with a spread in filter_groups_metric, before the cut to the target
    metrics: dict[str, float] = field(default_factory=dict)  # partial rollout's (partial_rollout.py)
    trained_batches: list[Any] | None = None  # partial rollout: the prompt batches of `trained`
    ref_log_probs: dict[str, np.ndarray] | None = None  # partial rollout: the reference's, streamed in earlier rollouts


@dataclass
class Rollout:
    """A generated iteration waiting to train: its groups, its clock, its version, its reference stream."""

    gen: _Generated
    clock: PhaseClock
    start: float
    weights_version: int
    ref_stream: LogProbStream | KnownLogProbs | None


@dataclass
class _Trained:
    batch: TrainBatch
    metrics: dict[str, float]  # the actor's update metrics and the staleness


class GrpoIteration:
    """Runs GRPO iterations against live services.

    Args:
        replicas: rollout replicas.
        score: the reward stream, `Reward.Score` of a worker or the coordinator's reward pool.
        actor: the actor trainer stub.
        reference: the reference trainer stub (None when no KL term is used; the actor's under share_backbone,
            called with adapters_off).
        decode: token ids -> text without special tokens (the tokenizer of the run).
        settings: see IterationSettings.
        placement: the device-sharing transitions and the weight sync (`placement.py`).
        multi_turn: the turn logic of a multi-turn run (`multi_turn.py`), else None.
        critic: PPO's critic trainer stub (None unless `settings.use_critic`).
    """

    def __init__(self, replicas: Sequence[Replica],
                 score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[reward_pb2.ScoreResponse]],
                 actor: Any, reference: Any | None, decode: Callable[[Sequence[int]], str],
                 settings: IterationSettings, placement: Placement, multi_turn: MultiTurn | None = None,
                 critic: Any | None = None) -> None:
        if settings.use_reference and reference is None:
            raise ValueError("a KL term needs a reference trainer")
        if settings.use_critic and critic is None:
            raise ValueError("PPO needs a critic trainer")
        self.generator = Generator(replicas, score, decode, settings, multi_turn)
        self.actor = actor
        self.reference = reference
        self.critic = critic
        self.decode = decode
        self.settings = settings
        self.placement = placement
        self.partial = (PartialRollouts(settings.n_samples_per_prompt, settings.global_batch_size)
                        if settings.partial_rollout_max_split > 1 else None)
        self.update_running = threading.Event()  # pipelined: partial rollout's asynchronous engine generates on
        self.kl_controller = make_kl_controller(settings.kl_ctrl_type, settings.init_kl_coef, settings.kl_target,
                                                settings.kl_horizon)

    def run(self, next_batch: Callable[[], Any], iteration: int, weights_version: int,
            data_batches: int = 0) -> IterationResult:
        """Runs iteration `iteration` with the replicas at `weights_version` (synchronous mode).

        Args:
            next_batch: takes the loader's next `PromptBatch` (advancing its cursor); called once per
                generation batch, so more than once with DAPO dynamic sampling.
            data_batches: generation batches in one pass over the data (bounds an unlimited
                `filter_groups_max_batches`).
        """
        rollout = self.rollout(next_batch, iteration, weights_version, data_batches)
        parts = self._train(rollout, iteration, weights_version)
        self.placement.after_update(rollout.clock, after_update(weights_version))
        return self._finish(rollout, parts, weights_version, rollout.start, time.perf_counter())

    def run_overlapped(self, rollout: Rollout, iteration: int, actor_version: int,
                       prefetch: Callable[[Callable[[], None]], list[Rollout]] | None
                       ) -> tuple[IterationResult, list[Rollout]]:
        """Pipelined mode: trains on `rollout` (sampled at most max_staleness versions behind the actor, which
        holds `actor_version`) while `prefetch` generates the next iterations on the replicas' current weights.

        `prefetch(on_generated)` calls `on_generated` once its last sample is in and it starts no more, before
        its scores and reference log-probs are: the new version is pushed as soon as both the update and the
        generation are done, so no generation ever sees weights change under it, and the scoring and the
        reference pass overlap the push. Returns this iteration's result and the prefetched rollouts."""
        start = time.perf_counter()
        # released: the last sample is in (generated), or the prefetch ended without it
        generated, released = threading.Event(), threading.Event()

        def on_generated() -> None:
            generated.set()
            released.set()

        def generate_ahead() -> Rollout:
            try:
                return prefetch(on_generated)
            finally:
                released.set()

        with ThreadPoolExecutor(1, thread_name_prefix="prefetch") as pool:
            self.update_running.set()
            ahead = pool.submit(generate_ahead) if prefetch is not None else None
            try:
                parts = self._train(rollout, iteration, actor_version)
                self.update_running.clear()
            except BaseException:
                self.update_running.clear()
                if ahead is not None:
                    wait([ahead])  # no generation may outlive a failed step; the update's error is the one raised
                raise
            if ahead is not None:
                released.wait()
                if not generated.is_set():
                    ahead.result()  # the prefetch failed before its last sample: the step fails before any push
            self.placement.after_update(rollout.clock, after_update(actor_version))
            following = ahead.result() if ahead is not None else []
        result = self._finish(rollout, parts, actor_version, start, time.perf_counter(),
                              also_busy=[r.clock for r in following])
        return result, following

    def rollout(self, next_batch: Callable[[], Any], iteration: int, weights_version: int,
                data_batches: int = 0, on_generated: Callable[[], None] | None = None) -> Rollout:
        """Phase 1: generate (and score, and stream to the reference) the iteration's prompts at `weights_version`.

        `on_generated` is called once the last sample is in and no more will be generated (before the scores
        and the reference log-probs are)."""
        clock = PhaseClock()
        t0 = time.perf_counter()
        self.placement.enter_infer(clock, weights_version)
        ref_stream = self._reference_stream(clock)
        try:
            gen = self._generate(next_batch, iteration, weights_version, data_batches, clock, ref_stream,
                                 on_generated)
        finally:
            if ref_stream is not None:
                ref_stream.close()
        self.placement.exit_infer(clock)
        known = KnownLogProbs(gen.ref_log_probs) if gen.ref_log_probs is not None else None
        return Rollout(gen, clock, t0, weights_version, known or ref_stream)

    def _train(self, rollout: Rollout, iteration: int, actor_version: int) -> _Trained:
        """Phases 2-5 on a rollout: score, advantages, log-prob passes, the actor's update (at `actor_version`)."""
        clock = rollout.clock
        trained = score_groups(rollout.gen.trained, rollout.weights_version, self.settings)
        staleness = fence(trained.groups, actor_version, self.settings.staleness_bound)
        adv_of = {} if self.settings.use_critic else self._advantages(trained, clock)
        # A streaming update: each Update request leaves as the reference's log-probs of its samples come back.
        streamed = rollout.ref_stream if self._streams_update(rollout.ref_stream) else None
        old_lp, ref_lp = self._log_prob_passes(trained.seqs, rollout.ref_stream, clock, join=streamed is None)
        critic_metrics: dict[str, float] = {}
        if self.settings.use_critic:
            # Imported with the first critic phase: GAE computes in torch (upstream's rounding), and a run without
            # a critic keeps torch out of the coordinator (~2.7 s of CPU at start-up, beside the other services').
            from services.coordinator.ppo import critic_phases
            adv_of, critic_metrics = critic_phases(self.critic, self.kl_controller, trained, iteration, clock,
                                                   old_lp, ref_lp, self.settings)
        s = self.settings
        if s.off_policy or s.rollout_correction:
            behavior = behavior_log_probs(trained.groups)
        else:  # measured by the trainer's update when no old-log-prob pass measures it here
            behavior = behavior_log_probs(trained.groups, required=False) if not old_lp else {}
        mismatch = rollout_mismatch(trained.groups, old_lp, actor_version)
        actor_metrics = self._update(trained.seqs, adv_of, old_lp, ref_lp, iteration, clock, behavior, streamed)
        return _Trained(trained, {**actor_metrics, **critic_metrics, **staleness, **mismatch})

    def _finish(self, rollout: Rollout, parts: _Trained, actor_version: int, t0: float, t_end: float,
                also_busy: Sequence[PhaseClock] = ()) -> IterationResult:
        """Phase 7: the iteration's metrics; `t0`..`t_end` is its wall span (what `timing/all` reports)."""
        clock, gen, trained = rollout.clock, rollout.gen, parts.batch
        timings = timing_metrics(clock, t0, t_end)
        # The coordinator's own time: the span during which no service call of this iteration (or of the
        # rollout generated beside it) was in flight.
        timings["timing/coordinator"] = coordinator_time(t0, t_end, clock, *also_busy)
        # The actor's reply carries its own timing/update; the coordinator's span (which update_tps and the
        # timeline use) is the one logged, so that the table stays consistent.
        metrics = {**parts.metrics, **gen.metrics, **timings, **timeline_metrics(clock, t0),
                   **trained_batch_metrics(gen, trained, timings, self.settings),
                   **self.placement.take_memory_metrics(), **self.generator.take_failover_metrics()}
        trained_ids = [g.group_id for g in gen.trained]
        logger.info("iteration trained %d groups (%d kept of %d generated in %d batches)",
                    len(trained_ids), gen.num_groups_kept, len(gen.generated), len(gen.batches))
        return IterationResult(metrics, after_update(actor_version), gen.batches, trained_ids)

    # -- phases, in order ---------------------------------------------------------------------------------

    def _generate(self, next_batch: Callable[[], Any], iteration: int, version: int, data_batches: int,
                  clock: PhaseClock, ref_stream: LogProbStream | None,
                  on_generated: Callable[[], None] | None = None) -> _Generated:
        """One prompt batch; with DAPO dynamic sampling, batches until enough groups have a spread (whether
        another batch is needed depends on the scores, so there generation ends with the scoring)."""
        s = self.settings
        if self.partial is not None:
            batches: list[Any] = []

            def admit_batch() -> None:
                batches.append(next_batch())
                self.partial.admit(self._group_prompts(batches[-1], iteration), batches[-1])

            taken, metrics = partial_rollout(self.generator, self.partial, admit_batch, version, clock,
                                             version + s.max_staleness, s.staleness_bound, self.update_running.is_set,
                                             ref_stream, on_generated)
            return _Generated(taken.groups, taken.groups, batches, len(taken.groups), metrics, taken.batches,
                              taken.ref_log_probs)
        if not s.filter_groups_enable:
            batch = next_batch()
            groups = self.generator.generate(self._group_prompts(batch, iteration), version, clock, ref_stream,
                                             on_generated)
            return _Generated(groups, groups, [batch], len(groups))
        acc: GroupAccumulator[Group] = GroupAccumulator(
            s.filter_groups_train_batch_size, s.n_samples_per_prompt, s.filter_groups_max_batches, data_batches)
        generated: list[Group] = []
        batches: list[Any] = []
        while not acc.ready:
            batch = next_batch()
            batches.append(batch)
            groups = self.generator.generate(self._group_prompts(batch, iteration), version, clock, ref_stream)
            generated.extend(groups)
            try:
                acc.add(groups, select_metric(verifier_scores(groups, s.verifiers), s.filter_groups_metric))
            except DynamicSamplingExhaustedError as e:
                raise IterationError(str(e)) from e
        if on_generated is not None:
            on_generated()
        taken = acc.take()
        return _Generated(generated, taken.groups, batches, taken.num_groups_kept)

    def _group_prompts(self, batch: Any, iteration: int) -> list[GroupPrompt]:
        # The batch index makes a group id unique in the run even when a prompt comes back in another batch.
        labels = batch.labels if batch.labels is not None else [None] * len(batch.prompts)
        return [GroupPrompt(f"it{iteration}/b{batch.batch_index}/p{int(pid)}", np.asarray(p, np.int32),
                            self.decode(lab.tolist()) if lab is not None else "")
                for pid, p, lab in zip(batch.prompt_indices, batch.prompts, labels, strict=True)]

    def _reference_stream(self, clock: PhaseClock) -> LogProbStream | None:
        if not (self.settings.use_reference and self.placement.streams_reference):
            return None
        return LogProbStream("reference_model", self.reference, self.settings,
                             self.settings.ref_forward_micro_batch_size, clock,
                             adapters_off=self.settings.share_backbone)

    def _advantages(self, trained: TrainBatch, clock: PhaseClock) -> dict[str, float]:
        start = time.perf_counter()
        adv_of = advantages_by_sample(trained, self.settings)
        clock.record("adv", start, time.perf_counter())
        return adv_of

    def _streams_update(self, ref_stream: LogProbStream | KnownLogProbs | None) -> bool:
        """Whether the update may start before the reference's last log-probs: they are all it waits for (no
        old-log-prob pass, no critic); not in a deterministic run (arrival order) nor a multi-turn one (tool-only
        requests)."""
        s = self.settings
        return (isinstance(ref_stream, LogProbStream) and s.skip_old_log_probs and not s.use_critic
                and not s.deterministic and self.generator.multi_turn is None)

    def _log_prob_passes(self, seqs: Sequences, ref_stream: LogProbStream | KnownLogProbs | None,
                         clock: PhaseClock, join: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(old log-probs, reference log-probs) of the trainable samples, by sample id; with `join` False the
        streamed reference's so far (a streaming update waits for the rest).

        A streamed reference finishes while the actor's old-log-prob pass runs (the overlap the non-overlap
        timings measure); a reference sharing the actor's devices runs first, onloaded around its pass.
        """
        s = self.settings
        ref_lp: dict[str, np.ndarray] = {}
        if s.use_reference and ref_stream is None and len(seqs):
            ref_lp = self.placement.reference_pass(clock, lambda: compute_log_probs(
                "reference_model", self.reference, seqs, s.ref_forward_micro_batch_size, s, clock,
                adapters_off=s.share_backbone))
        old_lp: dict[str, np.ndarray] = {}
        if not s.skip_old_log_probs and len(seqs):
            self.placement.enter_forward()
            old_lp = compute_log_probs("old_log_p", self.actor, seqs, s.actor_forward_micro_batch_size, s, clock)
        if ref_stream is not None:
            ref_lp = ref_stream.join() if join else ref_stream.log_probs
        return old_lp, ref_lp

    def _update(self, seqs: Sequences, adv_of: dict[str, float] | dict[str, np.ndarray], old_lp: dict[str, np.ndarray],
                ref_lp: dict[str, np.ndarray], iteration: int, clock: PhaseClock,
                behavior: dict[str, np.ndarray], streamed: LogProbStream | None = None) -> dict[str, float]:
        if not len(seqs):
            return {}
        s = self.settings
        kl_coef = self.kl_controller.value if s.kl_in_loss else 0.0

        def request(part: Sequences):
            return update_request(part, adv_of, old_lp, ref_lp, behavior, step=iteration, kl_coef=kl_coef,
                                  settings=s, batch_rows=len(seqs))

        failed: list[IterationError] = []
        requests = (requests_as_log_probs_arrive(streamed, seqs, s.ref_forward_micro_batch_size, request, failed)
                    if streamed is not None else
                    iter([request(seqs.take(i, i + s.update_chunk_size)) for i in range(0, len(seqs),
                                                                                    s.update_chunk_size)]))
        self.placement.enter_train(clock)
        start = time.perf_counter()
        try:
            reply = self.actor.Update(requests, timeout=s.deadline_s)
        except grpc.RpcError as e:
            if streamed is not None:
                streamed.join()  # the reference's own error, where it failed first
            if failed:
                raise failed[0] from e
            raise IterationError(f"actor Update: {e.code().name}: {e.details()}") from e
        if streamed is not None:
            streamed.join()
        clock.record("update", start, time.perf_counter())
        self.placement.exit_train(clock)
        metrics = dict(reply.metrics.values)
        if s.kl_in_loss:
            metrics["actor/kl_coef"] = kl_coef
            self.kl_controller.update(metrics.get("actor/kl_loss", 0.0), len(seqs))
        return metrics
