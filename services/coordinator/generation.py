"""Generation of one prompt batch: groups out to the rollout replicas, finished samples on to scoring.

`Generator.generate` sends each prompt group (token ids, never re-tokenised text) to a replica holding the
expected weights version; as samples stream back, each is decoded (without special tokens) and sent on to the
reward stream and, when a `LogProbStream` is given, to a trainer's log-prob stream in micro-batches, so that
scoring and the reference pass overlap the rollout. It returns when every sample of the batch is in and
scored. A sample that failed (for example a prompt longer than `max_model_len`) keeps its place in its group.

Failover: a replica whose stream breaks (its process died, or its host went silent past the channel's
keepalive) is taken out of the run's `ReplicaSet`, and its groups that had not returned all their samples
are re-sent to the surviving replicas. A re-sent group samples all n again; sample ids decide what counts,
so a sample that had already arrived keeps its first copy, the re-sent copy is dropped, and every sample
is scored exactly once. Only with no replica left does the iteration fail.

Multi-turn (`rl_config.multi_turn_enable`): each sample that streams back is one turn; continuations.py sends
its trajectory's continuations, and the trajectory, once finished, is scored as one sample.

`RequestStream` is the one helper behind both streams: a streaming RPC fed from a queue by this thread and
drained on its own, timed as one phase from its first request to its last reply.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from rlfabric.v1 import common_pb2, reward_pb2, rollout_pb2
from services.common.tensors import to_numpy, to_proto
from services.coordinator.continuations import Continuations, Finished, with_max_tokens
from services.coordinator.errors import IterationError
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.multi_turn import MultiTurn
from services.coordinator.settings import IterationSettings
from services.coordinator.weight_sync import Replica

if TYPE_CHECKING:
    from services.coordinator.log_prob_stream import LogProbStream

_DONE = object()


@dataclass
class _Lost:
    """A replica's stream broke: the groups it had not finished, for the survivors."""

    replica: Replica
    pending: list[rollout_pb2.GenerateRequest]
    error: str


class _StreamControl:
    """How the request streams of one `Generator.samples_of` call end: held open after their groups until the
    caller is done, then closed, with `GenerateRequest.interrupt` first when the caller interrupts."""

    def __init__(self) -> None:
        self.interrupt = False
        self._released = threading.Event()

    def end(self, *, interrupt: bool) -> None:
        if not self._released.is_set():
            self.interrupt = interrupt
            self._released.set()

    def requests(self, groups: list[rollout_pb2.GenerateRequest]) -> Iterator[rollout_pb2.GenerateRequest]:
        yield from groups
        self._released.wait()
        if self.interrupt:
            yield rollout_pb2.GenerateRequest(interrupt=True)


@dataclass(frozen=True)
class GroupPrompt:
    """One prompt to sample a group for: its group id, token ids and ground-truth answer text."""

    group_id: str
    prompt: np.ndarray  # int32 token ids
    answer: str


@dataclass
class Group:
    """A generated group: its prompt and its n samples (by index), each with its scores."""

    prompt: GroupPrompt
    samples: list[common_pb2.Sample]
    scores: list[reward_pb2.ScoreResponse]

    @property
    def group_id(self) -> str:
        return self.prompt.group_id

    def trainable(self) -> list[common_pb2.Sample]:
        """The samples that train: a response of at least one token and no error."""
        return [x for x in self.samples if x.response_length > 0 and not x.error]


class RequestStream:
    """A streaming RPC fed from a queue (`put`, then `close`) and drained on a background thread.

    Args:
        name: the phase it is timed as (`clock.record(name, first request, last reply)`).
        call: requests iterator -> replies iterator (the RPC with its deadline bound).
        sink: called with every reply, on the stream's thread.
    """

    def __init__(self, name: str, call: Callable[[Iterator[Any]], Iterator[Any]], sink: Callable[[Any], None],
                 clock: PhaseClock) -> None:
        self.name = name
        self._call, self._sink, self._clock = call, sink, clock
        self._requests: queue.Queue = queue.Queue()
        self._error: Exception | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, request: Any) -> None:
        self._requests.put(request)

    def close(self) -> None:
        """No more requests; idempotent."""
        if not self._closed:
            self._closed = True
            self._requests.put(_DONE)

    @property
    def ended(self) -> bool:
        """Whether the stream has taken its last reply (or failed)."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Waits for the last reply; raises the stream's error, if it had one."""
        self.close()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        first: float | None = None

        def requests() -> Iterator[Any]:
            nonlocal first
            while (item := self._requests.get()) is not _DONE:
                if first is None:
                    first = time.perf_counter()
                yield item

        try:
            for reply in self._call(requests()):
                self._sink(reply)
        except grpc.RpcError as e:
            self._error = IterationError(f"{self.name}: {e.code().name}: {e.details()}")
        finally:
            if first is not None:
                self._clock.record(self.name, first, time.perf_counter())


# Codes of a replica that is gone (died, unreachable, silent past keepalive) rather than one that refused.
_REPLICA_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Generator:
    """Samples prompt groups on the replicas and scores every sample (see module docstring).

    Args:
        replicas: the rollout replicas; groups are dealt round-robin.
        score: the reward stream (`Reward.Score` of a worker, or the coordinator's reward pool).
        decode: token ids -> text without special tokens.
        multi_turn: with `rl_config.multi_turn_enable`, the turn logic (multi_turn.py): each sample's turns
            go out as continuations until its trajectory ends, and the stitched trajectory is the sample.
    """

    def __init__(self, replicas: Sequence[Replica],
                 score: Callable[[Iterator[reward_pb2.ScoreRequest]], Iterator[reward_pb2.ScoreResponse]],
                 decode: Callable[[Sequence[int]], str], settings: IterationSettings,
                 multi_turn: MultiTurn | None = None) -> None:
        if not replicas:
            raise ValueError("at least one rollout replica is needed")
        # The run's ReplicaSet itself (not a copy): a lost replica leaves it for the weight sync too.
        self.replicas = replicas if isinstance(replicas, list) else list(replicas)
        self.score = score
        self.decode = decode
        self.settings = settings
        self._verifiers = [reward_pb2.VerifierSpec(name=name, weight=w) for name, w in settings.verifiers]
        self._threads: list[threading.Thread] = []
        self._control: _StreamControl | None = None  # samples_of's, while it runs
        self.failover = {"rollout/replicas_lost": 0.0, "rollout/groups_resent": 0.0,
                         "rollout/duplicate_samples_dropped": 0.0}
        self.multi_turn = multi_turn
        self._continuations = None if multi_turn is None else Continuations(
            multi_turn, self.replicas, self._deal, self._count_duplicate)

    def take_failover_metrics(self) -> dict[str, float]:
        """What failover did since the last call (all zero when no replica was lost), and the tool use of the
        multi-turn samples finished since then (`tool/*`)."""
        out = dict(self.failover)
        self.failover = dict.fromkeys(out, 0.0)
        if self.multi_turn is not None:
            out.update(self.multi_turn.take_metrics())
        return out

    def generate(self, prompts: Sequence[GroupPrompt], weights_version: int, clock: PhaseClock,
                 reference: LogProbStream | None = None,
                 on_generated: Callable[[], None] | None = None) -> list[Group]:
        """Every group of `prompts`, sampled at `weights_version` and scored, in prompt order; `on_generated`
        is called once every sample is in, before the scores are."""
        scores: dict[str, reward_pb2.ScoreResponse] = {}
        samples_q: queue.Queue = queue.Queue()
        reward = RequestStream("rule_reward", self.score, lambda r: scores.__setitem__(r.sample_id, r), clock)
        self._threads = []
        self._start_rollout(prompts, weights_version, clock, samples_q)
        try:
            samples = self._receive(prompts, samples_q, reward, reference, weights_version, clock)
        finally:
            reward.close()
        if on_generated is not None:
            on_generated()
        for t in self._threads:
            t.join()
        reward.join()
        missing = [x for x in samples if x not in scores]
        if missing:
            raise IterationError(f"reward: no score for {len(missing)} samples (first: {missing[:3]})")
        n = self.settings.n_samples_per_prompt
        out = []
        for p in prompts:
            ids = [f"{p.group_id}/{i}" for i in range(n)]
            out.append(Group(p, [samples[x] for x in ids], [scores[x] for x in ids]))
        return out

    def sampling_params(self) -> common_pb2.SamplingParams:
        """The run's sampling values (generate_config.sampling_config, the run's seed), as every request sends them."""
        s = self.settings
        return common_pb2.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, has_temperature=True,
                                         top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                                         seed=s.seed or 0, has_seed=s.seed is not None)

    def group_requests(self, prompts: Sequence[GroupPrompt], version: int, sampling: common_pb2.SamplingParams,
                       cap: int | None = None) -> list[rollout_pb2.GenerateRequest]:
        """One request per prompt for its n samples, each with its response budget (at most `cap` tokens)."""
        s, requests = self.settings, []
        for p in prompts:
            group = common_pb2.PromptGroup(group_id=p.group_id, prompt_token_ids=to_proto(np.asarray(p.prompt, np.int32)),
                                           n=s.n_samples_per_prompt)
            budget = min(s.response_budget(len(p.prompt)), cap or s.max_tokens)
            own = sampling if budget == sampling.max_tokens else with_max_tokens(sampling, budget)
            requests.append(rollout_pb2.GenerateRequest(group=group, expected_weights_version=version, sampling=own))
        return requests

    def _start_rollout(self, prompts: Sequence[GroupPrompt], version: int, clock: PhaseClock,
                       out: queue.Queue) -> None:
        sampling = self.sampling_params()
        if self._continuations is not None:
            self._continuations.start(sampling)
        requests = self.group_requests(prompts, version, sampling)
        if not self.replicas:
            raise IterationError("no rollout replica left (every one was lost and none has joined)")
        self._deal(requests, list(self.replicas), clock, out)

    def samples_of(self, requests: list[rollout_pb2.GenerateRequest], clock: PhaseClock,
                   interrupt_when: Callable[[], bool] | None = None) -> Iterator[common_pb2.Sample]:
        """Sends `requests` to the replicas (round-robin, failing over as `generate` does) and yields each sample
        once, as it arrives, until every request's n samples are in (partial rollout's rounds). `interrupt_when`,
        asked after each sample and every 50 ms: once true, every stream gets `GenerateRequest.interrupt`, and
        the samples still generating come back with what they have (FINISH_REASON_INTERRUPTED)."""
        if not self.replicas:
            raise IterationError("no rollout replica left (every one was lost and none has joined)")
        samples_q: queue.Queue = queue.Queue()
        self._threads = []
        control = self._control = _StreamControl() if interrupt_when is not None else None
        try:
            self._deal(requests, list(self.replicas), clock, samples_q)
            expected = sum(q.group.n for q in requests)
            seen: set[str] = set()
            arrivals = self._arrivals(samples_q, clock, lambda: f"{expected - len(seen)} of {expected} samples",
                                      control, interrupt_when)
            while len(seen) < expected:
                item = next(arrivals)
                if item.sample_id in seen:
                    self._count_duplicate()
                else:
                    seen.add(item.sample_id)
                    yield item
        finally:
            if control is not None:
                control.end(interrupt=False)  # the request streams end (what is still running is cancelled)
            self._control = None
        for t in self._threads:
            t.join()

    def score_request(self, sample: common_pb2.Sample, answer: str) -> reward_pb2.ScoreRequest:
        """The reward stream's request for `sample` (its response decoded without special tokens)."""
        response = to_numpy(sample.response_token_ids) if sample.response_length else np.zeros(0, np.int32)
        return reward_pb2.ScoreRequest(sample_id=sample.sample_id, response=self.decode(response.tolist()),
                                       ground_truth=answer, verifiers=self._verifiers)

    def _deal(self, requests: list[rollout_pb2.GenerateRequest], replicas: list[Replica], clock: PhaseClock,
              out: queue.Queue) -> None:
        """Round-robin over `replicas`, one streaming call (on its own thread) per replica."""
        for r, replica in enumerate(replicas):
            share = requests[r::len(replicas)]
            if share:
                t = threading.Thread(target=self._rollout_on, args=(replica, share, clock, out, self._control),
                                     name=f"rollout-{replica.address}", daemon=True)
                self._threads.append(t)
                t.start()

    def _rollout_on(self, replica: Replica, requests: list[rollout_pb2.GenerateRequest], clock: PhaseClock,
                    out: queue.Queue, control: _StreamControl | None = None) -> None:
        start = time.perf_counter()
        returned: dict[str, int] = {}
        stream = iter(requests) if control is None else control.requests(requests)
        try:
            for reply in replica.stub.Generate(stream, timeout=self.settings.deadline_s):
                returned[reply.sample.group_id] = returned.get(reply.sample.group_id, 0) + 1
                out.put(reply.sample)
        except grpc.RpcError as e:
            error = f"rollout {replica.address}: {e.code().name}: {e.details()}"
            if e.code() in _REPLICA_GONE:
                pending = [q for q in requests if returned.get(q.group.group_id, 0) < q.group.n]
                out.put(_Lost(replica, pending, error))
            else:  # the replica answered: a refusal (version, input) that another replica would repeat
                out.put(IterationError(error))
        finally:
            clock.record("rollout", start, time.perf_counter())

    def _fail_over(self, lost: _Lost, clock: PhaseClock, out: queue.Queue) -> None:
        """Takes the lost replica out of the run and re-sends its unfinished groups to the survivors."""
        lose = getattr(self.replicas, "lose", None)
        if lose is not None:
            lose(lost.replica, lost.error)
        elif lost.replica in self.replicas:
            self.replicas.remove(lost.replica)
        self.failover["rollout/replicas_lost"] += 1
        survivors = list(self.replicas)
        if not survivors:
            raise IterationError(f"{lost.error}; no rollout replica left for its {len(lost.pending)} groups")
        self.failover["rollout/groups_resent"] += len(lost.pending)
        self._deal(lost.pending, survivors, clock, out)

    def _receive(self, prompts: Sequence[GroupPrompt], samples_q: queue.Queue, reward: RequestStream,
                 reference: LogProbStream | None, version: int, clock: PhaseClock) -> dict[str, common_pb2.Sample]:
        """Takes every sample off the rollout queue, forwarding each to scoring (and to the reference)."""
        by_group = {p.group_id: p for p in prompts}
        samples: dict[str, common_pb2.Sample] = {}
        expected = len(prompts) * self.settings.n_samples_per_prompt
        arrivals = self._arrivals(samples_q, clock, lambda: f"{expected - len(samples)} of {expected} samples")
        while len(samples) < expected:
            item = next(arrivals)
            if isinstance(item, Finished):
                item = self.multi_turn.finish(item.trajectory)
            elif self._continuations is not None:  # one turn of a trajectory: it continues or comes back Finished
                self._continuations.on_turn(item, by_group, version, clock, samples_q)
                continue
            if item.sample_id in samples:
                self._count_duplicate()
                continue  # a re-sent group sampled again one we already hold: the first copy counts
            samples[item.sample_id] = item
            prompt = by_group[item.group_id]
            reward.put(self.score_request(item, prompt.answer))
            if reference is not None and item.response_length and not item.error:
                reference.add(item, prompt.prompt, version)
        if reference is not None:
            reference.flush(version)
        return samples

    def _arrivals(self, samples_q: queue.Queue, clock: PhaseClock, missing: Callable[[], str],
                  control: _StreamControl | None = None,
                  interrupt_when: Callable[[], bool] | None = None) -> Iterator[Any]:
        """What the rollout streams put on `samples_q`, as it comes (samples; multi-turn `Finished`s): a lost
        replica's groups fail over to the others, a replica's refusal is raised, and nothing for deadline_s raises
        IterationError naming `missing()`. With `control` and `interrupt_when` (samples_of's), the rule is asked before
        each wait of at most 50 ms. The caller takes items until it has what it expects."""
        deadline_s = self.settings.deadline_s
        deadline = time.monotonic() + deadline_s
        while True:
            if control is not None and not control.interrupt and interrupt_when():
                control.end(interrupt=True)
            try:
                item = samples_q.get(timeout=0.05 if control is not None else deadline_s)
            except queue.Empty:
                if control is not None and time.monotonic() < deadline:
                    continue
                raise IterationError(f"rollout: {missing()} missing after {deadline_s:.0f}s") from None
            deadline = time.monotonic() + deadline_s
            if isinstance(item, _Lost):
                self._fail_over(item, clock, samples_q)
            elif isinstance(item, Exception):
                raise item
            else:
                yield item

    def _count_duplicate(self) -> None:
        self.failover["rollout/duplicate_samples_dropped"] += 1
