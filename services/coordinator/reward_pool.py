"""Coordinator-side pool over all reward workers: discovery, least-loaded routing, failover, dedup.

`RewardClientPool.score(requests)` takes any iterable of `ScoreRequest` (a generator fed by rollout is
fine) and yields exactly one `ScoreResponse` per distinct sample id, in completion order:
- workers are discovered in the Redis `Registry` (`ServiceKind.REWARD`) and re-read every `refresh_s`, so a
  worker that joins mid-stream starts receiving samples;
- each sample goes to the live worker with the fewest samples in flight (ties: the one sent fewest), at most
  `max_inflight_per_worker` each (back-pressure instead of unbounded queues on the workers);
- a dead worker is noticed within seconds: its stream breaks at once when its process dies (the
  kernel resets the connection), and within `keepalive` seconds when its host or network goes silent.
  The streams' channels have no retry policy: gRPC would otherwise retry a call whose server died
  before its first answer, and that call would hang instead of failing;
- a lost worker's unanswered samples are re-sent to the others, once per sample: a sample id that is
  still in flight on another worker (hedged) is not sent again. A sample unanswered after
  `sample_timeout_s` is also sent to another worker (hedged), and the silent worker gets no new samples
  until it answers again (a hung worker must not attract the work);
- a worker that deregisters (scaled down) is drained: no new samples, its stream half-closed, and it ends
  the stream once it has answered what it held;
- answers are keyed by sample id: the first one counts, later duplicates are dropped, so a re-sent
  sample is never counted twice. A sample that no worker could answer after `max_attempts` sends gets a
  response whose scores carry the error (score 0), so the caller still gets one answer per sample and
  sees it failed (`ClientPoolStats.gave_up`, and the error on each `VerifierScore`).
"""

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import auth_metadata, channel_options, raw_channel
from services.common.redis_store import Registry
from services.common.service_kind import ServiceKind

logger = logging.getLogger(__name__)


@dataclass
class ClientPoolStats:
    """What happened during `score` calls (for logs and tests)."""

    sent: int = 0
    resent: int = 0  # re-sent because the worker holding them was lost
    hedged: int = 0  # also sent elsewhere because their worker did not answer in `sample_timeout_s`
    duplicates_dropped: int = 0
    workers_lost: int = 0
    drained: int = 0  # deregistered workers that answered everything they held before their stream ended
    gave_up: int = 0
    answered: int = 0  # distinct samples answered, each exactly once (given-up ones included, scored 0)
    per_worker: dict[str, int] = field(default_factory=dict)


# The iteration metrics of `RewardClientPool.take_failover_metrics`: metric name -> ClientPoolStats field.
FAILOVER_METRICS = {"reward/samples_scored": "answered", "reward/workers_lost": "workers_lost",
                    "reward/samples_resent": "resent", "reward/samples_hedged": "hedged",
                    "reward/duplicate_scores_dropped": "duplicates_dropped", "reward/samples_given_up": "gave_up"}


# Most samples one ScoreRequestBatch carries: what is waiting in the link's outbox, up to this.
_MAX_REQUESTS_PER_BATCH = 64
# A lost worker's registration outlives it by up to its lease; do not route to it again before this.
_LOST_WORKER_QUARANTINE_S = 30.0


def _stream_channel(endpoint: str, keepalive_s: float) -> grpc.Channel:
    """A channel for long streams: keepalive pings find a silent peer; no retry policy (see the module doc).

    Pings every `keepalive_s` while a stream is open (the servers allow one per 10 s without data), with
    no cap on pings without data, so a worker that stops answering is declared dead after about
    `keepalive_s` + 5 s.
    """
    drop = {"grpc.enable_retries", "grpc.service_config", "grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms"}
    options = [option for option in channel_options() if option[0] not in drop]
    options += [("grpc.enable_retries", 0), ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", 5_000), ("grpc.http2.max_pings_without_data", 0)]
    return raw_channel(endpoint, options)  # TLS when this process has a CA (services/common/security.py)


class _Link:
    """One open `Score` stream to one worker.

    Samples and answers travel in batches of whatever is ready together, so one gRPC message (and one
    thread wake-up on each end) serves many samples when the stream is busy and one when it is not.
    """

    def __init__(self, instance_id: str, endpoint: str, events: queue.SimpleQueue, token: str | None,
                 keepalive_s: float) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.inflight: dict[str, float] = {}  # sample_id -> time sent
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._channel = _stream_channel(endpoint, keepalive_s)
        self._call = reward_pb2_grpc.RewardStub(self._channel).Score(
            self._requests(), metadata=auth_metadata(token) if token else None)
        self._events = events
        self.alive = True
        # Set when a sample sent here ran past the deadline; cleared by the next answer. A stalled worker
        # gets no new samples while another one can take them (else it would attract all the work).
        self.stalled = False
        self.sent = 0  # samples sent on this stream
        self.draining = False  # deregistered: no new samples, input half-closed (see _Session._drain_departed)
        threading.Thread(target=self._read, name=f"reward-link-{instance_id}", daemon=True).start()

    def _requests(self) -> Iterator[reward_pb2.ScoreRequestBatch]:
        while True:
            batch = [self._outbox.get()]
            while batch[-1] is not None and len(batch) < _MAX_REQUESTS_PER_BATCH:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            if done:
                batch.pop()
            if batch:
                yield reward_pb2.ScoreRequestBatch(requests=batch)
            if done:
                return

    def _read(self) -> None:
        try:
            for batch in self._call:
                self._events.put(("results", self, batch.responses))
            self._events.put(("lost", self, "stream ended"))
        except grpc.RpcError as e:
            self._events.put(("lost", self, f"{e.code().name}: {e.details()}"))

    def send(self, request: reward_pb2.ScoreRequest) -> None:
        self.sent += 1
        self.inflight[request.sample_id] = time.monotonic()
        self._outbox.put(request)

    def finish_input(self) -> None:
        self._outbox.put(None)

    def close(self) -> None:
        self.alive = False
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()


class RewardClientPool:
    """Scores samples on every registered reward worker.

    Args:
        registry: the Redis membership registry the workers register in.
        token: bearer token sent with every call (workers only require it for registration RPCs).
        keepalive_s: ping interval on open streams (a silent worker is lost after about this + 5 s).
        max_inflight_per_worker: samples sent to one worker and not yet answered.
        sample_timeout_s: re-send a sample unanswered this long to another worker.
        max_attempts: sends per sample before giving up on it (its response then carries the error).
        refresh_s: how often to re-read the registry.
        no_worker_timeout_s: raise when no worker is registered for this long while work is waiting.
    """

    def __init__(self, registry: Registry, *, token: str | None = None, max_inflight_per_worker: int = 64,
                 sample_timeout_s: float = 60.0, max_attempts: int = 4, refresh_s: float = 0.5,
                 no_worker_timeout_s: float = 60.0, keepalive_s: float = 15.0,
                 service: ServiceKind = ServiceKind.REWARD) -> None:
        self._registry = registry
        self._token = token
        self._max_inflight = max_inflight_per_worker
        self._sample_timeout_s = sample_timeout_s
        self._max_attempts = max_attempts
        self._refresh_s = refresh_s
        self._no_worker_timeout_s = no_worker_timeout_s
        self._keepalive_s = keepalive_s
        self._service = service
        self.stats = ClientPoolStats()
        self._taken = ClientPoolStats()
        # (instance_id, endpoint) -> when it was lost; kept across `score` calls (iterations).
        self.lost: dict[tuple[str, str], float] = {}

    def take_failover_metrics(self) -> dict[str, float]:
        """`FAILOVER_METRICS` since the last call: what scoring and failover did during one iteration."""
        out = {name: float(getattr(self.stats, f) - getattr(self._taken, f)) for name, f in FAILOVER_METRICS.items()}
        self._taken = ClientPoolStats(**{f: getattr(self.stats, f) for f in FAILOVER_METRICS.values()})
        return out

    def score(self, requests: Iterable[reward_pb2.ScoreRequest]) -> Iterator[reward_pb2.ScoreResponse]:
        """Yields one response per distinct sample id of `requests`, in completion order."""
        return _Session(self, requests).run()


class _Session:
    """The state of one `score` call; all of it is touched by the caller's thread only."""

    def __init__(self, pool: RewardClientPool, requests: Iterable[reward_pb2.ScoreRequest]) -> None:
        self.pool = pool
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[str, reward_pb2.ScoreRequest] = {}
        self.attempts: dict[str, int] = {}
        self.pending: deque[str] = deque()
        self.done: set[str] = set()
        self.links: dict[str, _Link] = {}
        self.input_done = False
        self.last_refresh = 0.0
        self.last_timeout_check = 0.0
        self.no_worker_since: float | None = None
        threading.Thread(target=self._feed, args=(requests,), name="reward-pool-feed", daemon=True).start()

    def _feed(self, requests: Iterable[reward_pb2.ScoreRequest]) -> None:
        try:
            for request in requests:
                self.events.put(("request", None, request))
        except Exception as e:  # noqa: BLE001 (re-raised in the caller's thread by run())
            self.events.put(("input_error", None, e))
            return
        self.events.put(("input_done", None, None))

    def run(self) -> Iterator[reward_pb2.ScoreResponse]:
        try:
            while not (self.input_done and len(self.done) == len(self.requests)):
                self._refresh()
                self._dispatch()
                self._check_timeouts()
                try:
                    kind, link, payload = self.events.get(timeout=self.pool._refresh_s)
                except queue.Empty:
                    continue
                yield from self._handle_all(kind, link, payload)
                # Drain whatever else is ready before the (slower) refresh/dispatch round.
                while True:
                    try:
                        kind, link, payload = self.events.get_nowait()
                    except queue.Empty:
                        break
                    yield from self._handle_all(kind, link, payload)
                    self._dispatch()
        finally:
            for link in self.links.values():
                link.close()

    def _handle_all(self, kind: str, link: _Link | None, payload) -> list[reward_pb2.ScoreResponse]:
        """The answers an event brings: a batch of results, or what `_handle` makes of one event."""
        if kind == "results":
            answers = [self._handle("result", link, response) for response in payload]
            return [answer for answer in answers if answer is not None]
        answer = self._handle(kind, link, payload)
        return [] if answer is None else [answer]

    def _handle(self, kind: str, link: _Link | None, payload) -> reward_pb2.ScoreResponse | None:
        if kind == "request":
            sample_id = payload.sample_id
            if sample_id in self.requests:
                return None  # the same sample twice in the input: one answer
            self.requests[sample_id] = payload
            self.attempts[sample_id] = 0
            self.pending.append(sample_id)
        elif kind == "input_done":
            self.input_done = True
        elif kind == "input_error":
            raise RuntimeError(f"the iterable of ScoreRequests given to score() failed: {payload!r}") from payload
        elif kind == "result":
            link.inflight.pop(payload.sample_id, None)
            link.stalled = False
            if payload.sample_id in self.done or payload.sample_id not in self.requests:
                self.pool.stats.duplicates_dropped += 1
                return None
            self.done.add(payload.sample_id)
            self.pool.stats.answered += 1
            if link.instance_id:
                per_worker = self.pool.stats.per_worker
                per_worker[link.instance_id] = per_worker.get(link.instance_id, 0) + 1
            return payload
        elif kind == "lost":
            return self._lose(link, payload)
        return None

    def _lose(self, link: _Link, why: str) -> None:
        if self.links.get(link.instance_id) is not link:
            return None
        del self.links[link.instance_id]
        link.close()
        self.pool.lost[(link.instance_id, link.endpoint)] = time.monotonic()
        # Once per sample id: not when answered, nor while another worker holds it (hedged).
        held_elsewhere = {sid for other in self.links.values() for sid in other.inflight}
        orphans = [sid for sid in link.inflight if sid not in self.done and sid not in held_elsewhere]
        if link.draining and not orphans:
            self.pool.stats.drained += 1
            logger.info("reward worker %s drained", link.instance_id)
            return None
        self.pool.stats.workers_lost += 1
        logger.warning("reward worker %s at %s lost (%s); re-sending its %d unanswered samples", link.instance_id,
                       link.endpoint, why, len(orphans))
        for sample_id in reversed(orphans):
            self.pending.appendleft(sample_id)  # ahead of new work, in their original order
        self.pool.stats.resent += len(orphans)
        return None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self.last_refresh < self.pool._refresh_s and self.links:
            return
        self.last_refresh = now
        try:
            members = self.pool._registry.members(self.pool._service)
        except Exception as e:  # noqa: BLE001 (keep serving with the links we have)
            logger.warning("could not read reward workers from Redis: %s", e)
            return
        self._drain_departed({member.instance_id for member in members})
        for member in members:
            key = (member.instance_id, member.endpoint)
            lost_at = self.pool.lost.get(key)
            if member.instance_id in self.links or (lost_at is not None and now - lost_at < _LOST_WORKER_QUARANTINE_S):
                continue
            self.links[member.instance_id] = _Link(member.instance_id, member.endpoint, self.events,
                                                   self.pool._token, self.pool._keepalive_s)
            logger.info("routing reward samples to worker %s at %s", member.instance_id, member.endpoint)

    def _drain_departed(self, registered: set[str]) -> None:
        """A worker that deregistered (`reward serve` on SIGTERM, `rlfabric system scale`) gets no new samples:
        its stream is half-closed, it answers what it holds and ends the stream, and `_lose` then finds
        nothing to re-send. What it fails to answer is re-sent as for any lost worker."""
        for link in self.links.values():
            if link.instance_id not in registered and not link.draining:
                link.draining = True
                link.finish_input()
                logger.info("reward worker %s deregistered: draining its %d samples", link.instance_id,
                            len(link.inflight))

    def _dispatch(self) -> None:
        while self.pending:
            live = [link for link in self.links.values()
                    if len(link.inflight) < self.pool._max_inflight and not link.draining]
            responsive = [link for link in live if not link.stalled]
            live = responsive or live
            if not live:
                break
            sample_id = self.pending.popleft()
            if sample_id in self.done:
                continue
            if self.attempts[sample_id] >= self.pool._max_attempts:
                self._give_up(sample_id, f"no reward worker answered after {self.attempts[sample_id]} attempts")
                continue
            # Ties (idle workers while samples trickle in) go to the one sent least: else the first worker
            # would take every sample and a worker added at run time would get none.
            link = min(live, key=lambda candidate: (len(candidate.inflight), candidate.sent))
            self.attempts[sample_id] += 1
            link.send(self.requests[sample_id])
            self.pool.stats.sent += 1

    def _give_up(self, sample_id: str, why: str) -> None:
        request = self.requests[sample_id]
        failed = reward_pb2.ScoreResponse(sample_id=sample_id)
        for spec in request.verifiers:
            failed.scores.add(verifier=spec.name, score=0.0, error=f"unavailable: {why}")
        self.pool.stats.gave_up += 1
        self.events.put(("result", _GAVE_UP, failed))  # counted like an answer, once

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if self.pending and not self.links:
            self.no_worker_since = self.no_worker_since or now
            if now - self.no_worker_since > self.pool._no_worker_timeout_s:
                raise RuntimeError(
                    f"no reward worker registered under service '{self.pool._service}' for "
                    f"{self.pool._no_worker_timeout_s:g} s; start one with `rlfabric reward serve --redis-url ...`"
                )
        else:
            self.no_worker_since = None
        if now - self.last_timeout_check < 0.1:
            return  # scanning every in-flight sample on every event would cost more than the answers
        self.last_timeout_check = now
        for link in list(self.links.values()):
            for sample_id, sent_at in list(link.inflight.items()):
                if now - sent_at > self.pool._sample_timeout_s and sample_id not in self.done:
                    del link.inflight[sample_id]  # hedge: also ask another worker; first answer wins
                    link.stalled = True
                    self.pending.append(sample_id)
                    self.pool.stats.hedged += 1


class _GaveUpLink:
    """Stands in for a worker in the event of a sample nobody could score."""

    instance_id = ""
    inflight: dict[str, float] = {}


_GAVE_UP = _GaveUpLink()
