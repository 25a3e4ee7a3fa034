"""A GRPO run: discovers the services, loops over iterations, journals every step, checkpoints, resumes.

The run's durable state lives in the Redis journal (`RunJournal`): the data cursor (consumed batches),
the weights version the replicas serve, the last finished iteration and the last checkpoint. A killed
coordinator restarted with `resume` continues from the last checkpoint: the actor trainer has loaded it
(`finetune: false`, `load`), the loader skips the batches consumed up to it, and the replicas are
re-synced to a fresh weights version before anything is generated, so no stale weights ever serve.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.client import make_channel
from services.common.config.ppo import critic_save_dir
from services.common.deadlines import CHECKPOINT_DEADLINE_S, INFO_DEADLINE_S
from services.common.redis_store import Registry, RunJournal
from services.common.service_kind import ServiceKind, TrainerRole
from services.common.weight_version import AS_LOADED, first_of_run
from services.coordinator.errors import IterationError
from services.coordinator.iteration import GrpoIteration, Rollout
from services.coordinator.partial_rollout import batch_of, prompt_key
from services.coordinator.placement import OffloadKeys, Placement
from services.coordinator.replicas import ReplicaSet
from services.coordinator.settings import settings_from_config
from services.coordinator.sinks import MetricsSink
from services.coordinator.validation import Validation, plan_from_config
from services.coordinator.weight_sync import Replica, WeightSync

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Where the run's services are."""

    rollout: list[str]
    actor: str
    reference: str | None
    critic: str | None = None


class _Stepper:
    """One iteration of the run loop: synchronous (`max_staleness` 0, `GrpoIteration.run`) or pipelined (N >= 1):
    while this iteration trains, the rollouts of the next ones are generated, up to N iterations ahead, and held
    until their turn. The first is always generated; each further one starts only while the update still runs (so
    the rollout does not idle beside it), and all of one step's share the replicas' weights: the rollout of
    iteration k + j trains j versions later, within the fence.

    Called as step(iteration, version) -> (result, consumed batches); in pipelined mode the consumed count
    leaves out the batches of the rollouts generated ahead, and with partial rollout every batch from the first one
    with a group still in the pool, so a checkpoint's data cursor names only trained batches and a resumed run
    generates the discarded ones again.
    """

    def __init__(self, loop: GrpoIteration, loader: Any, journaled: Callable[[Any, int], Callable[[], Any]],
                 train_iters: int, stop_event: threading.Event, max_staleness: int) -> None:
        self.loop, self.loader, self.journaled = loop, loader, journaled
        self.train_iters, self.stop_event, self.depth = train_iters, stop_event, max_staleness
        self.ahead: list[Rollout] = []

    def __call__(self, iteration: int, version: int) -> tuple[Any, int]:
        loader = self.loader
        if not self.depth:
            result = self.loop.run(self.journaled(loader, iteration), iteration, version, loader.batches_per_epoch)
            return result, self._cursor(loader.consumed_batches)
        rollout = self.ahead.pop(0) if self.ahead else self.loop.rollout(
            self.journaled(loader, iteration), iteration, version, loader.batches_per_epoch)
        first, last = iteration + 1 + len(self.ahead), min(self.train_iters, iteration + self.depth)
        prefetch = None
        if first <= last and not self.stop_event.is_set():
            def prefetch(on_generated: Callable[[], None]) -> list[Rollout]:
                return self._generate_ahead(first, last, version, on_generated)
        result, following = self.loop.run_overlapped(rollout, iteration, version, prefetch)
        self.ahead.extend(following)
        return result, self._cursor(loader.consumed_batches)

    def _generate_ahead(self, first: int, last: int, version: int, on_generated: Callable[[], None]) -> list[Rollout]:
        """The rollouts of iterations `first`.. at `version`: the next one only while the update runs and up to
        `last`; `on_generated` once the last one's samples are in."""
        out: list[Rollout] = []
        for m in range(first, last + 1):
            ended = threading.Event()

            def generated(final: bool = m == last, ended: threading.Event = ended) -> None:
                if final or not self.loop.update_running.is_set() or self.stop_event.is_set():
                    ended.set()
                    on_generated()

            out.append(self.loop.rollout(self.journaled(self.loader, m), m, version, self.loader.batches_per_epoch,
                                         generated))
            if ended.is_set():
                break
        return out

    def _cursor(self, consumed: int) -> int:
        """The data cursor a checkpoint names: the batches before the first one that has a group not trained yet
        (generated ahead, or in partial rollout's pool), which a resumed run generates again."""
        pool = self.loop.partial
        if pool is None:
            return consumed - sum(len(r.gen.batches) for r in self.ahead)
        untrained = pool.batches_in_flight() + [b for r in self.ahead for b in (r.gen.trained_batches or [])]
        return min((b.batch_index for b in untrained), default=consumed)


class DiscoveryError(RuntimeError):
    pass


class StoppedError(RuntimeError):
    """StopRun arrived before the run had its services: it ends "stopped", not "failed"."""


def discover(registry: Registry, *, need_reference: bool, min_rollout: int = 1, timeout_s: float = 300.0,
             poll_s: float = 0.5, stop: threading.Event | None = None, need_critic: bool = False) -> Endpoints:
    """Waits until the registry holds an actor trainer, a reference and a critic (when needed) and `min_rollout`
    replicas.

    Raises StoppedError as soon as `stop` is set: a StopRun used to wait out the whole discovery timeout.
    """
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
        rollout = sorted(m.endpoint for m in registry.members(ServiceKind.ROLLOUT))
        trainers = {m.metadata.get("role"): m.endpoint for m in registry.members(ServiceKind.TRAINER)}
        actor, reference, critic = (trainers.get(r) for r in TrainerRole)
        if len(rollout) >= min_rollout and actor and (reference or not need_reference) and (critic or not need_critic):
            return Endpoints(rollout, actor, reference, critic)
        if time.monotonic() > deadline:
            raise DiscoveryError(
                f"after {timeout_s:.0f}s the registry holds {len(rollout)} rollout replica(s) (need {min_rollout}), "
                f"actor trainer: {actor or 'missing'}, reference trainer: "
                f"{reference or ('missing' if need_reference else 'not needed')}"
                f"{', critic trainer: ' + (critic or 'missing') if need_critic else ''}; start the missing services "
                "(`rlfabric up` starts them all) and check they use the same --redis-url")
        if stop.wait(poll_s):
            raise StoppedError("stopped while waiting for the run's services")


class RunDriver:
    """Runs `train_iters` GRPO iterations of one config against live services.

    Args:
        cfg: the loaded `RLFabricConfig`.
        run_id: the journal key.
        registry, journal: the Redis layer.
        loader_factory: consumed_batches -> PromptLoader (so resume can position it).
        decode: token ids -> text (skip special tokens).
        score: the reward stream (a `RewardClientPool.score` or a worker's `Score`).
        sink: where iteration metrics go.
        hf_config: the model's HF config.json (for resharding plans).
        score_metrics: what scoring did since its previous call (the reward pool's `take_failover_metrics`:
            samples scored, workers lost, samples re-sent); merged into each iteration's metrics.
    """

    def __init__(self, cfg: Any, run_id: str, registry: Registry, journal: RunJournal,
                 loader_factory: Callable[[int], Any], decode: Callable[[list[int]], str], score: Callable,
                 sink: MetricsSink, hf_config: dict[str, Any], *, token: str | None = None,
                 discovery_timeout_s: float = 300.0,
                 score_metrics: Callable[[], dict[str, float]] = dict, multi_turn: Any = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.registry = registry
        self.journal = journal
        self.loader_factory = loader_factory
        self.decode = decode
        self.score = score
        self.sink = sink
        self.hf_config = hf_config
        self.token = token
        self.discovery_timeout_s = discovery_timeout_s
        self.score_metrics = score_metrics
        self.multi_turn = multi_turn  # services/coordinator/multi_turn.py MultiTurn, with multi_turn_enable
        self.settings = settings_from_config(cfg)
        self.validation = Validation(plan_from_config(cfg, decode))
        self.stop_event = threading.Event()

    def run(self, resume: bool = False) -> None:
        """Runs to `train_iters` (or until `stop_event`); the journal holds the outcome. Raises on failure."""
        try:
            self._run(resume)
        except Exception as e:
            self.journal.write(phase="failed", error=f"{type(e).__name__}: {e}")
            raise

    def _run(self, resume: bool) -> None:
        mt = self.cfg.actor_config
        train_iters = int(mt.train_iters)  # required when the config loads
        previous = self.journal.read()
        if "iteration" not in previous:
            previous = {}  # only the "starting" mark StartRun wrote: a fresh run
        if previous and not resume:
            raise RuntimeError(f"run {self.run_id!r} already has a journal (iteration {previous.get('iteration')}); "
                               "resume it or choose another run id")
        try:
            endpoints = discover(self.registry,
                                 need_reference=self.settings.use_reference and not self.settings.share_backbone,
                                 timeout_s=self.discovery_timeout_s, stop=self.stop_event,
                                 need_critic=self.settings.use_critic)
        except StoppedError:
            self.journal.write(phase="stopped")
            return
        channels = [make_channel(a, token=self.token) for a in [*endpoints.rollout, endpoints.actor]]

        def connect_replica(address: str) -> Replica:  # a replica that joins mid-run (services/coordinator/replicas.py)
            channels.append(make_channel(address, token=self.token))
            return Replica(address, rollout_pb2_grpc.RolloutStub(channels[-1]))

        replicas = ReplicaSet([Replica(a, rollout_pb2_grpc.RolloutStub(c))
                               for a, c in zip(endpoints.rollout, channels, strict=False)],
                              self.registry, connect_replica)
        actor = trainer_pb2_grpc.TrainerStub(channels[-1])
        reference = None
        if endpoints.reference and not self.settings.share_backbone:
            channels.append(make_channel(endpoints.reference, token=self.token))
            reference = trainer_pb2_grpc.TrainerStub(channels[-1])
        critic = None
        if endpoints.critic and self.settings.use_critic:
            channels.append(make_channel(endpoints.critic, token=self.token))
            critic = trainer_pb2_grpc.TrainerStub(channels[-1])
        try:
            s = self.settings
            sync = WeightSync(actor, replicas, self.hf_config, s.deadline_s, actor_address=endpoints.actor,
                              transport=s.weight_transport)
            # share_backbone: the reference is the actor's backbone (ComputeLogProbs with adapters_off); the
            # placement has no reference trainer to move.
            placement = Placement(s.use_integrated_worker, actor, reference, replicas, sync,
                                  OffloadKeys(s.offload_train_param, s.offload_train_grad, s.offload_train_optimizer),
                                  s.deadline_s)
            placement.prepare()
            iteration, consumed, version = self._starting_point(previous, actor, replicas, sync)
            if critic is not None:
                self._check_critic_iteration(critic, iteration)
            loader = self.loader_factory(consumed)
            seed = self._sampling_seed(previous)
            settings = dataclasses.replace(s, seed=seed)
            loop = GrpoIteration(replicas, self.score, actor, actor if s.share_backbone else reference, self.decode,
                                 settings, placement,
                                 multi_turn=self.multi_turn, critic=critic)
            self.validation.start(replicas, self.score, self.decode, settings, placement, iteration=iteration,
                                  version=version, sink=self.sink)
            self.journal.forget_iterations_after(iteration)  # computed again from here (a resume past them)
            self.journal.write(phase="running", iteration=iteration, start_iteration=iteration, weights_version=version,
                               consumed_batches=consumed,
                               train_iters=train_iters, rollout=endpoints.rollout, sampling_seed=seed, error="")
            step = _Stepper(loop, loader, self._journaled, train_iters, self.stop_event, s.max_staleness)
            # Prompts trained in batches at or past the data cursor (partial rollout only; see partial_rollout.py).
            trained_past_cursor = set((previous.get("checkpoint") or {}).get("trained_past_cursor", []))
            if loop.partial is not None:
                loop.partial.trained_before_resume = set(trained_past_cursor)
            while iteration < train_iters and not self.stop_event.is_set():
                iteration += 1
                result, consumed = step(iteration, version)
                trained_past_cursor = {k for k in trained_past_cursor | {prompt_key(g) for g in result.trained_groups}
                                       if batch_of(k) >= consumed}
                version = result.weights_version
                first = result.batches[0]
                metrics = {**result.metrics, **self.score_metrics(), "iteration": float(iteration), "weights_version": float(version),
                           "data/batch_index": float(first.batch_index), "data/epoch": float(first.epoch),
                           "data/consumed_batches": float(consumed)}
                metrics.update(self.validation.after_iteration(iteration, train_iters, version))
                detail = {"batches": [b.batch_index for b in result.batches], "trained_groups": result.trained_groups}
                self.journal.record_iteration(iteration, metrics, detail=detail, weights_version=version,
                                              consumed_batches=consumed, phase="iteration_done")
                self.sink.write(iteration, metrics)
                if mt.save and ((mt.save_interval and iteration % mt.save_interval == 0) or iteration == train_iters):
                    placement.checkpoint(functools.partial(self._checkpoint, actor, iteration, consumed, critic,
                                                           sorted(trained_past_cursor)))
            self.journal.write(phase="done" if iteration >= train_iters else "stopped")
        finally:
            for c in channels:
                c.close()

    def _journaled(self, loader: Any, iteration: int) -> Callable[[], Any]:
        """The loader's next batch, each one journaled as it is taken (DAPO may take several per iteration)."""

        def next_batch() -> Any:
            batch = loader.next_batch()
            self.journal.write(phase="rollout", current_iteration=iteration, batch_index=batch.batch_index)
            return batch

        return next_batch

    def _sampling_seed(self, previous: dict[str, Any]) -> int:
        """The run's sampling seed: the config's, else the one journaled by an earlier start, else fresh entropy.

        Journaling a drawn seed makes a resumed run redraw exactly the samples the uninterrupted run would have.
        """
        if self.settings.seed is not None:
            return int(self.settings.seed)
        if previous.get("sampling_seed") is not None:
            return int(previous["sampling_seed"])
        return secrets.randbits(63)

    def _starting_point(self, previous: dict[str, Any], actor: Any, replicas: list[Replica],
                        sync: WeightSync) -> tuple[int, int, int]:
        """(iteration, consumed batches, weights version) to continue from, after syncing the replicas."""
        gbs = int(self.cfg.actor_config.global_batch_size)
        info = actor.Info(trainer_pb2.TrainerInfoRequest(), timeout=INFO_DEADLINE_S)
        iteration = int(info.iteration)
        consumed = 0
        if previous:
            ckpt = previous.get("checkpoint") or {}
            if int(ckpt.get("iteration", 0)) != iteration:
                raise RuntimeError(
                    f"run {self.run_id!r}: the journal's last checkpoint is iteration {ckpt.get('iteration', 0)} but "
                    f"the actor trainer holds iteration {iteration}; start the trainer with "
                    f"`load: {ckpt.get('path', self.cfg.actor_config.save)}` and `finetune: false`")
            consumed = int(ckpt.get("consumed_samples", 0)) // gbs
        elif iteration:
            # A trainer resumed from a checkpoint without this run's journal: GRPO takes exactly one prompt batch
            # per iteration, so the cursor follows from the iteration. DAPO's dynamic sampling takes a varying
            # number, which only the journal records: guessing would re-train or skip data silently.
            if self.settings.filter_groups_enable:
                raise RuntimeError(
                    f"run {self.run_id!r}: the actor trainer holds iteration {iteration} but the journal has no "
                    f"record of this run, and with rl_config.filter_groups_enable each iteration may take several "
                    f"prompt batches, so the data cursor cannot be derived; resume with the run's journal (same "
                    f"run id and Redis) or start the trainer without `load`")
            consumed = iteration
        # Always sync before generating anything: the replicas may hold other weights than the actor (a fresh
        # replica loads the HF folder, a resumed actor a checkpoint). Versions only move forward, across restarts
        # too, so a number that was ever served never names other weights.
        held = [r.stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=INFO_DEADLINE_S).weights_version for r in replicas]
        version = first_of_run(int(previous.get("weights_version", AS_LOADED)), int(info.weights_version), *held)
        start = time.perf_counter()
        sync.push(version)
        logger.info("synced %d replica(s) to weights version %d in %.2fs", len(replicas), version,
                    time.perf_counter() - start)
        return iteration, consumed, version

    def _check_critic_iteration(self, critic: Any, iteration: int) -> None:
        """PPO: the critic must hold the actor's iteration (both resume from checkpoints of the same iteration)."""
        held = int(critic.Info(trainer_pb2.TrainerInfoRequest(), timeout=INFO_DEADLINE_S).iteration)
        if held != iteration:
            raise RuntimeError(f"run {self.run_id!r}: the actor trainer holds iteration {iteration} but the critic "
                               f"holds iteration {held}; start the critic from its checkpoint of iteration "
                               f"{iteration} (`critic_config.load: {critic_save_dir(self.cfg)}`, `finetune: false`)")

    def _checkpoint(self, actor: Any, iteration: int, consumed_batches: int, critic: Any | None = None,
                    trained_past_cursor: list[str] | None = None) -> None:
        self.journal.write(phase="checkpoint")
        save = str(Path(self.cfg.actor_config.save))
        gbs = int(self.cfg.actor_config.global_batch_size)
        try:
            reply = actor.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(
                dir=save, iteration=iteration, consumed_samples=consumed_batches * gbs), timeout=CHECKPOINT_DEADLINE_S)
            if critic is not None:  # before the journal names the checkpoint: a resume finds both or neither
                critic.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(
                    dir=critic_save_dir(self.cfg), iteration=iteration, consumed_samples=consumed_batches * gbs),
                    timeout=CHECKPOINT_DEADLINE_S)
        except Exception as e:
            raise IterationError(f"checkpoint at iteration {iteration} failed: {e}") from e
        self.journal.write(checkpoint={"iteration": iteration, "path": reply.path,
                                       "consumed_samples": consumed_batches * gbs,
                                       "trained_past_cursor": trained_past_cursor or []})
        logger.info("checkpoint %s (iteration %d) in %.2fs", reply.path, iteration, reply.duration_s)
