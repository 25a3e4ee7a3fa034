"""One GRPO iteration as the coordinator runs it, over the services' gRPC stubs.

The order (see docs/architecture.md, "One GRPO iteration"):
1. prompt groups go to the rollout replicas holding `weights_version` (token ids in, never re-tokenised);
2. while samples stream back, each is decoded and sent on to the reward stream and, in micro-batches, to
   the reference trainer's log-prob stream, so scoring and the reference pass overlap the rollout;
3. when every sample is in: the actor's old log-probs (skipped when fully on-policy), group advantages;
4. the actor's `Update` over the whole batch;
5. weight sync: the actor pushes the new version to every replica, which acks it with a checksum.

A sample that fails (for example a prompt longer than `max_model_len`) costs that sample: it scores 0,
keeps its place in its group for the normalisation, and contributes no tokens to the update.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2, trainer_pb2
from services.common.sequences import Sequences, split_response_values
from services.common.tensors import to_numpy, to_proto
from services.coordinator.advantages import (
    apply_overlong_penalty,
    compute_group_advantages,
    make_kl_controller,
)
from services.coordinator.iteration_metrics import PhaseClock, batch_metrics, timing_metrics

logger = logging.getLogger(__name__)

_DONE = object()


@dataclass(frozen=True)
class IterationSettings:
    """What one iteration needs from the config (built by `settings_from_config`)."""

    n_samples_per_prompt: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # The run's sampling seed (sampling_config.seed, or one drawn for the run and journaled; see RunDriver).
    seed: int | None = None
    verifiers: tuple[tuple[str, float], ...] = (("math_17k_acc", 1.0),)
    use_reference: bool = True
    skip_old_log_probs: bool = True
    ref_forward_micro_batch_size: int = 16
    actor_forward_micro_batch_size: int = 16
    update_chunk_size: int = 64
    overlong_buffer_enable: bool = False
    overlong_buffer: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    rollout_max_tokens: int = 0
    world_size: int = 1
    log_max_throughput: bool = False
    deadline_s: float = 600.0  # rlfabric.rpc_deadline_s
    kl_ctrl_type: str = "fixed"
    init_kl_coef: float = 0.001
    kl_target: float | None = None
    kl_horizon: float | None = None


@dataclass
class Replica:
    """A rollout replica the coordinator talks to."""

    address: str
    stub: Any  # rollout_pb2_grpc.RolloutStub


@dataclass
class IterationResult:
    metrics: dict[str, float]
    weights_version: int


class IterationError(RuntimeError):
    """An iteration could not complete; the message says which service and why."""


def _drain(q: queue.Queue) -> Iterator[Any]:
    while (item := q.get()) is not _DONE:
        yield item


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

    def __init__(self, replicas: Sequence[Replica], score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[reward_pb2.ScoreResponse]],
                 actor: Any, reference: Any | None, decode: Callable[[Sequence[int]], str],
                 settings: IterationSettings, weight_sync: WeightSync) -> None:
        if not replicas:
            raise ValueError("at least one rollout replica is needed")
        if settings.use_reference and reference is None:
            raise ValueError("a KL term needs a reference trainer")
        self.replicas = list(replicas)
        self.score = score
        self.actor = actor
        self.reference = reference
        self.decode = decode
        self.settings = settings
        self.weight_sync = weight_sync
        self.kl_controller = make_kl_controller(settings.kl_ctrl_type, settings.init_kl_coef, settings.kl_target,
                                                settings.kl_horizon)

    # -- phases -------------------------------------------------------------------------------------------

    def _rollout(self, groups: list[common_pb2.PromptGroup], version: int, clock: PhaseClock,
                 out: queue.Queue) -> list[threading.Thread]:
        s = self.settings
        sampling = common_pb2.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, has_temperature=True,
                                             top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                                             seed=s.seed or 0, has_seed=s.seed is not None)
        threads = []
        for r, replica in enumerate(self.replicas):
            mine = groups[r::len(self.replicas)]
            if not mine:
                continue

            def run(replica: Replica = replica, mine: list = mine) -> None:
                start = time.perf_counter()
                requests = [rollout_pb2.GenerateRequest(group=g, expected_weights_version=version, sampling=sampling)
                            for g in mine]
                try:
                    for reply in replica.stub.Generate(iter(requests), timeout=s.deadline_s):
                        out.put(reply.sample)
                except grpc.RpcError as e:
                    out.put(IterationError(f"rollout {replica.address}: {e.code().name}: {e.details()}"))
                finally:
                    clock.record("rollout", start, time.perf_counter())

            threads.append(threading.Thread(target=run, name=f"rollout-{r}", daemon=True))
        for t in threads:
            t.start()
        return threads

    def _stream(self, name: str, call: Callable[[Iterator[Any]], Iterator[Any]], requests: queue.Queue,
                sink: Callable[[Any], None], clock: PhaseClock, errors: list) -> threading.Thread:
        def run() -> None:
            first = [None]

            def timed() -> Iterator[Any]:
                for item in _drain(requests):
                    if first[0] is None:
                        first[0] = time.perf_counter()
                    yield item

            try:
                for reply in call(timed()):
                    sink(reply)
            except grpc.RpcError as e:
                errors.append(IterationError(f"{name}: {e.code().name}: {e.details()}"))
            finally:
                if first[0] is not None:
                    clock.record(name, first[0], time.perf_counter())

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def _log_probs(self, stub: Any, seqs: Sequences, micro: int) -> dict[str, np.ndarray]:
        requests = [trainer_pb2.LogProbRequest(batch=seqs.take(i, i + micro).to_proto(),
                                               temperature=self.settings.temperature)
                    for i in range(0, len(seqs), micro)]
        lengths = dict(zip(seqs.sample_ids, seqs.response_lengths.tolist(), strict=True))
        out: dict[str, np.ndarray] = {}
        try:
            for reply in stub.ComputeLogProbs(iter(requests), timeout=self.settings.deadline_s):
                _collect_log_probs(reply, lengths, out)
        except grpc.RpcError as e:
            raise IterationError(f"actor ComputeLogProbs: {e.code().name}: {e.details()}") from e
        return out

    # -- the iteration ------------------------------------------------------------------------------------

    def run(self, prompts: Sequence[np.ndarray], labels: Sequence[np.ndarray] | None, iteration: int,
            weights_version: int, prompt_ids: Sequence[int] | None = None) -> IterationResult:
        """Runs iteration `iteration` on `prompts` with the replicas at `weights_version`."""
        s = self.settings
        n = s.n_samples_per_prompt
        clock = PhaseClock()
        t0 = time.perf_counter()
        prompt_ids = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
        groups = [common_pb2.PromptGroup(group_id=f"it{iteration}/p{pid}", prompt_token_ids=to_proto(np.asarray(p, np.int32)), n=n)
                  for pid, p in zip(prompt_ids, prompts, strict=True)]
        group_pos = {g.group_id: i for i, g in enumerate(groups)}
        answers = [self.decode(lab.tolist()) for lab in labels] if labels is not None else [""] * len(prompts)

        samples_q: queue.Queue = queue.Queue()
        reward_q: queue.Queue = queue.Queue()
        ref_q: queue.Queue = queue.Queue()
        errors: list[Exception] = []
        scores: dict[str, reward_pb2.ScoreResponse] = {}
        ref_lp: dict[str, np.ndarray] = {}
        response_lengths: dict[str, int] = {}  # by sample id; the reference replies are split with them

        rollout_threads = self._rollout(groups, weights_version, clock, samples_q)
        reward_thread = self._stream("rule_reward", self.score, reward_q, lambda r: scores.__setitem__(r.sample_id, r),
                                     clock, errors)
        ref_thread = None
        if s.use_reference:
            ref_thread = self._stream(
                "reference_model", lambda it: self.reference.ComputeLogProbs(it, timeout=s.deadline_s), ref_q,
                lambda r: _collect_log_probs(r, response_lengths, ref_lp), clock, errors)

        verifier_specs = [reward_pb2.VerifierSpec(name=name, weight=w) for name, w in s.verifiers]
        samples: dict[str, common_pb2.Sample] = {}
        pending_ref: list[common_pb2.Sample] = []
        expected = len(groups) * n
        while len(samples) < expected:
            try:
                item = samples_q.get(timeout=s.deadline_s)
            except queue.Empty:
                raise IterationError(f"rollout: {expected - len(samples)} of {expected} samples missing after "
                                     f"{s.deadline_s:.0f}s") from None
            if isinstance(item, Exception):
                reward_q.put(_DONE)
                ref_q.put(_DONE)
                raise item
            if item.sample_id in samples:
                continue  # a retried group re-sent a sample we already hold
            samples[item.sample_id] = item
            response_lengths[item.sample_id] = item.response_length
            gi = group_pos[item.group_id]
            response = to_numpy(item.response_token_ids) if item.response_length else np.zeros(0, np.int32)
            reward_q.put(reward_pb2.ScoreRequest(
                sample_id=item.sample_id, response=self.decode(response.tolist()), ground_truth=answers[gi],
                verifiers=verifier_specs))
            if s.use_reference and item.response_length:
                pending_ref.append(item)
                if len(pending_ref) >= s.ref_forward_micro_batch_size:
                    ref_q.put(self._ref_request(_sequences(pending_ref, prompts, group_pos, weights_version)))
                    pending_ref = []
        if pending_ref:
            ref_q.put(self._ref_request(_sequences(pending_ref, prompts, group_pos, weights_version)))
        reward_q.put(_DONE)
        ref_q.put(_DONE)
        for t in rollout_threads:
            t.join()
        reward_thread.join()
        if ref_thread is not None:
            ref_thread.join()
        if errors:
            raise errors[0]

        # Group order: prompt by prompt, sample index within the group.
        order = sorted(samples.values(), key=lambda x: (group_pos[x.group_id], x.index))
        missing = [x.sample_id for x in order if x.sample_id not in scores]
        if missing:
            raise IterationError(f"reward: no score for {len(missing)} samples (first: {missing[:3]})")
        rewards = np.array([scores[x.sample_id].reward if not x.error else 0.0 for x in order], dtype=np.float64)
        lengths = np.array([x.response_length for x in order], dtype=np.int64)
        if s.overlong_buffer_enable:
            rewards = apply_overlong_penalty(rewards, lengths, s.rollout_max_tokens or s.max_tokens, s.overlong_buffer,
                                             s.overlong_buffer_penalty_factor)

        trained = [x for x in order if x.response_length > 0 and not x.error]
        seqs = _sequences(trained, prompts, group_pos, weights_version)
        old_lp: dict[str, np.ndarray] = {}
        if not s.skip_old_log_probs and len(seqs):
            start = time.perf_counter()
            old_lp = self._log_probs(self.actor, seqs, s.actor_forward_micro_batch_size)
            clock.record("old_log_p", start, time.perf_counter())

        start = time.perf_counter()
        advantages = compute_group_advantages(rewards, n)
        adv_of = {x.sample_id: a for x, a in zip(order, advantages, strict=True)}
        clock.record("adv", start, time.perf_counter())

        start = time.perf_counter()
        actor_metrics = self._update(seqs, adv_of, old_lp, ref_lp, iteration) if len(seqs) else {}
        clock.record("update", start, time.perf_counter())

        start = time.perf_counter()
        new_version = weights_version + 1
        self.weight_sync.push(new_version)
        clock.record("resharding_to_infer", start, time.perf_counter())
        t_end = time.perf_counter()

        timings = timing_metrics(clock, t0, t_end)
        verifier_scores = {
            name: [scores[x.sample_id].scores[i].score for x in order] for i, (name, _w) in enumerate(s.verifiers)
        }
        metrics = {**timings, **actor_metrics}
        metrics.update(batch_metrics(
            rewards=rewards, verifier_scores=verifier_scores,
            prompt_lengths=[x.prompt_length for x in order], response_lengths=lengths.tolist(),
            global_batch_size=len(groups), n_samples_per_prompt=n, world_size=s.world_size, timings=timings,
            log_max_throughput=s.log_max_throughput))
        # A sample fails in rollout (`Sample.error`) or in reward (an error on a verifier score: a timeout,
        # a crash, or no worker left to score it); either way its reward is not a verdict.
        metrics["failed_samples"] = float(sum(1 for x in order
                                              if x.error or any(s.error for s in scores[x.sample_id].scores)))
        return IterationResult(metrics, new_version)

    def _ref_request(self, seqs: Sequences) -> trainer_pb2.LogProbRequest:
        return trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=self.settings.temperature)

    def _update(self, seqs: Sequences, adv_of: dict[str, float], old_lp: dict[str, np.ndarray],
                ref_lp: dict[str, np.ndarray], iteration: int) -> dict[str, float]:
        s = self.settings
        requests = []
        for i in range(0, len(seqs), s.update_chunk_size):
            chunk = seqs.take(i, i + s.update_chunk_size)
            ids = chunk.sample_ids
            req = trainer_pb2.UpdateRequest(
                batch=chunk.to_proto(),
                advantages=to_proto(np.array([adv_of[x] for x in ids], dtype=np.float32)),
                temperature=s.temperature, step=iteration, kl_coef=self.kl_controller.value if s.use_reference else 0.0)
            if old_lp:
                req.old_log_probs.CopyFrom(to_proto(np.concatenate([old_lp[x] for x in ids]).astype(np.float32)))
            if s.use_reference:
                missing = [x for x in ids if x not in ref_lp]
                if missing:
                    raise IterationError(f"reference: no log-probs for {len(missing)} samples (first: {missing[:3]})")
                req.ref_log_probs.CopyFrom(to_proto(np.concatenate([ref_lp[x] for x in ids]).astype(np.float32)))
            requests.append(req)
        try:
            reply = self.actor.Update(iter(requests), timeout=s.deadline_s)
        except grpc.RpcError as e:
            raise IterationError(f"actor Update: {e.code().name}: {e.details()}") from e
        metrics = dict(reply.metrics.values)
        if s.use_reference:
            metrics["actor/kl_coef"] = self.kl_controller.value
            self.kl_controller.update(metrics.get("actor/kl_loss", 0.0), len(seqs))
        return metrics


class WeightSync:
    """Pushes the actor's weights to the rollout replicas, with the resharding plan this coordinator computes.

    The plan comes from `Trainer.Info` and `Rollout.Info` (both with parameters); replicas that load different
    parameter sets get their own plan. Plans are computed once and reused for every push: layouts do not change
    during a run, and a failed push drops them so the next push asks the services again. Every replica must
    acknowledge the version, or the push fails naming the ones that did not.
    """

    def __init__(self, actor: Any, replicas: Sequence[Replica], hf_config: dict[str, Any], deadline_s: float) -> None:
        self.actor = actor
        self.replicas = list(replicas)
        self.hf_config = hf_config
        self.deadline_s = deadline_s
        self._plans: list[tuple[list[str], bytes]] | None = None  # (targets, plan) per replica layout

    def _plan(self) -> list[tuple[list[str], bytes]]:
        from services.coordinator.resharding import plan_resharding

        groups: dict[tuple, tuple[list[str], Any]] = {}
        for r in self.replicas:
            params = r.stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=60).parameters
            signature = tuple((p.name, tuple(p.shape), p.dtype) for p in params)
            groups.setdefault(signature, ([], params))[0].append(r.address)
        shards = self.actor.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards
        return [(targets, plan_resharding(shards, params, self.hf_config).to_json())
                for targets, params in groups.values()]

    def push(self, version: int) -> None:
        try:
            if self._plans is None:
                self._plans = self._plan()
            for targets, plan in self._plans:
                self._push(targets, version, plan)
        except (grpc.RpcError, IterationError) as e:
            self._plans = None  # a replica may have restarted with another layout: plan afresh next time
            if isinstance(e, IterationError):
                raise
            raise IterationError(f"weight sync: {e.code().name}: {e.details()}") from e

    def _push(self, targets: list[str], version: int, plan: bytes) -> None:
        acked: dict[str, int] = {}
        request = trainer_pb2.PushWeightsRequest(version=version, targets=targets, plan=plan)
        for progress in self.actor.PushWeights(request, timeout=self.deadline_s):
            if progress.done:
                acked[progress.target] = progress.checksum
        missing = sorted(set(targets) - set(acked))
        if missing:
            raise IterationError(f"weight sync: replicas {missing} did not acknowledge version {version}")


def _sequences(samples: Sequence[common_pb2.Sample], prompts: Sequence[np.ndarray], group_pos: dict[str, int],
               weights_version: int) -> Sequences:
    """Each sample's prompt followed by its response, as one flat batch."""
    return Sequences.from_lists([x.sample_id for x in samples], [prompts[group_pos[x.group_id]] for x in samples],
                                [to_numpy(x.response_token_ids) for x in samples], weights_version)


def _collect_log_probs(reply: trainer_pb2.LogProbResponse, lengths: dict[str, int],
                       out: dict[str, np.ndarray]) -> None:
    """Splits a reply's flat log-probs per sample; the lengths are those of the request, by sample id."""
    ids = list(reply.sample_ids)
    parts = split_response_values(to_numpy(reply.log_probs), [lengths[x] for x in ids])
    out.update(zip(ids, parts, strict=True))


def settings_from_config(cfg: Any) -> IterationSettings:
    """IterationSettings from a loaded `RLFabricConfig` (see services/common/config)."""
    rl, sampling, derived = cfg.rl_config, cfg.generate_config.sampling_config, cfg.derived
    return IterationSettings(
        n_samples_per_prompt=rl.n_samples_per_prompt,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        verifiers=tuple(zip(rl.verifier_function, (float(w) for w in rl.verifier_weight), strict=True)),
        use_reference=derived.use_kl_loss,
        skip_old_log_probs=derived.skip_old_log_probs,
        ref_forward_micro_batch_size=rl.ref_forward_micro_batch_size,
        actor_forward_micro_batch_size=rl.actor_forward_micro_batch_size,
        overlong_buffer_enable=rl.overlong_buffer_enable,
        overlong_buffer=rl.overlong_buffer,
        overlong_buffer_penalty_factor=rl.overlong_buffer_penalty_factor,
        rollout_max_tokens=rl.rollout_max_tokens,
        world_size=derived.actor_world_size or 1,
        log_max_throughput=rl.log_max_throughput,
        kl_ctrl_type=rl.kl_ctrl_type,
        init_kl_coef=rl.init_kl_coef,
        deadline_s=cfg.rlfabric.rpc_deadline_s,
        kl_target=rl.kl_target,
        kl_horizon=rl.kl_horizon,
    )
