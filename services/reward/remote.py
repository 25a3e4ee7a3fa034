"""Calls to registered remote verifiers: batched streams, deadlines, bounded concurrency, a circuit breaker.

Samples waiting for a verifier share `Verifier.Verify` streams: a call carries its share of the requests
queued when it starts (ceil(queued / max_concurrency), within `_MIN/_MAX_REQUESTS_PER_CALL`), answers are
matched by request id, and each request keeps its own deadline (the verifier's `timeout_s`, capped by the
sample's deadline; an answer after it is a timeout). One stream per sample cost more than a fast verifier's
verdicts (a burst of 64 regex checks took ~0.12 s that way, 0.03-0.05 s batched: bench/RESULTS.md, "End
to end"). At most `max_concurrency` calls run at once per verifier and worker (a thread pool of that size), so
a slow verifier still gets that many streams side by side, and one slow verdict holds up only the few
requests behind it in its stream (a simple server answers a stream's requests in turn). After
`failure_threshold` consecutive failed verdicts the circuit opens: calls fail at once with `circuit_open`
for `cooldown_s`, then one trial call decides whether it closes again. While the last verdict failed, a
call carries one request (a bad call then costs one sample, as before batching). A failure costs the sample
a 0 score with the reason; never the stream.
"""

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import redis

from rlfabric.v1 import verifier_pb2, verifier_pb2_grpc
from services.common.client import make_channel
from services.reward import metrics
from services.reward.endpoints import EndpointPolicy, EndpointRefusedError
from services.reward.outcome import CIRCUIT_OPEN, NON_FINITE, REMOTE, TIMEOUT, Outcome
from services.reward.pool import SampleClock
from services.reward.verifier_store import RemoteVerifierEntry, VerifierStore

logger = logging.getLogger(__name__)

# Requests per Verify call: its share of the queue, at least the first (fewer calls when many are queued:
# a call costs more than a fast verdict), at most the second (a stream's requests are answered in turn by
# simple servers, so a slow verdict holds up those behind it).
_MIN_REQUESTS_PER_CALL, _MAX_REQUESTS_PER_CALL = 8, 64


class CircuitBreaker:
    """Closed -> open after `failure_threshold` consecutive failures -> half-open after `cooldown_s`."""

    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 5.0) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_running = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """True when a call may go out now."""
        with self._lock:
            if self._opened_at is None:
                return True
            if time.monotonic() - self._opened_at < self.cooldown_s or self._trial_running:
                return False
            self._trial_running = True  # half-open: exactly one trial call
            return True

    def record(self, success: bool) -> None:
        with self._lock:
            self._trial_running = False
            if success:
                self._failures, self._opened_at = 0, None
                return
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._opened_at = time.monotonic()

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened_at is not None

    @property
    def healthy(self) -> bool:
        """True while the last verdict succeeded (or none failed yet)."""
        with self._lock:
            return self._failures == 0


@dataclass
class _Queued:
    request: verifier_pb2.VerifyRequest
    clock: SampleClock
    future: "Future[Outcome]"


class RemoteVerifier:
    """Client of one registered remote verifier, shared by all streams of a worker."""

    def __init__(self, entry: RemoteVerifierEntry, *, failure_threshold: int = 5, cooldown_s: float = 5.0) -> None:
        self.entry = entry
        # A user's server, not one of ours: it must never see the service token (nor need our CA).
        self._channel = make_channel(entry.endpoint, token=None, tls_ca=None)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        self._executor = ThreadPoolExecutor(max_workers=entry.max_concurrency,
                                            thread_name_prefix=f"remote-{entry.name}")
        self.breaker = CircuitBreaker(failure_threshold, cooldown_s)
        self._queue: deque[_Queued] = deque()
        self._lock = threading.Lock()
        self._callers = 0  # pool threads draining the queue (at most max_concurrency)
        self.calls = 0  # Verify calls made (observability and tests)

    def submit(self, request_id: str, response: str, ground_truth: str, prompt: str,
               clock: SampleClock) -> "Future[Outcome]":
        """Queues one verification; the future always resolves to an Outcome (cancel() drops a queued one)."""
        future: Future[Outcome] = Future()
        request = verifier_pb2.VerifyRequest(request_id=request_id, response=response, ground_truth=ground_truth,
                                             prompt=prompt)
        with self._lock:
            self._queue.append(_Queued(request, clock, future))
            start = self._callers < self.entry.max_concurrency
            if start:
                self._callers += 1
        if start:
            self._executor.submit(self._drain)
        return future

    def _drain(self) -> None:
        """A pool thread's loop: one call per batch taken off the queue, until the queue is empty."""
        while True:
            with self._lock:
                batch = self._take()
                if not batch:
                    self._callers -= 1
                    return
            self._call(batch)

    def _take(self) -> list[_Queued]:
        """The next call's requests (under the lock): queued, not cancelled, ids unique within the call."""
        share = max(_MIN_REQUESTS_PER_CALL, -(-len(self._queue) // self.entry.max_concurrency))
        limit = min(share, _MAX_REQUESTS_PER_CALL) if self.breaker.healthy else 1
        batch: list[_Queued] = []
        ids: set[str] = set()
        later: list[_Queued] = []
        while self._queue and len(batch) < limit:
            item = self._queue.popleft()
            if item.request.request_id in ids:
                later.append(item)  # the same sample from two streams: answers are matched by id
            elif item.future.set_running_or_notify_cancel():
                batch.append(item)
                ids.add(item.request.request_id)
        self._queue.extendleft(reversed(later))
        return batch

    def _call(self, batch: list[_Queued]) -> None:
        name = self.entry.name
        started = time.monotonic()
        live: list[tuple[_Queued, float]] = []  # (request, its own deadline)
        for item in batch:
            deadline = min(started + self.entry.timeout_s, item.clock.deadline())
            if deadline <= started:
                item.future.set_result(Outcome.failed(TIMEOUT, "the sample's deadline passed before the call "
                                                               "started", 0.0))
            else:
                live.append((item, deadline))
        if not live:
            return
        if not self.breaker.allow():
            metrics.REMOTE_CIRCUIT_OPEN.labels(name).set(1)
            for item, _ in live:
                item.future.set_result(Outcome.failed(CIRCUIT_OPEN, f"{name} at {self.entry.endpoint} failed "
                                                      f"repeatedly; retrying after {self.breaker.cooldown_s:g} s", 0.0))
            return
        self.calls += 1
        outcomes = self._exchange(live, started)
        for item, _ in live:
            outcome = outcomes[item.request.request_id]
            self.breaker.record(not outcome.reason)
            item.future.set_result(outcome)
        metrics.REMOTE_CIRCUIT_OPEN.labels(name).set(1 if self.breaker.is_open else 0)

    def _exchange(self, live: list[tuple[_Queued, float]], started: float) -> dict[str, Outcome]:
        """One Verify call carrying `live`; an Outcome for every request id."""
        pending = {item.request.request_id: deadline for item, deadline in live}
        outcomes: dict[str, Outcome] = {}
        call = None
        try:
            call = self._stub.Verify(iter([item.request for item, _ in live]),
                                     timeout=max(pending.values()) - started)
            for reply in call:
                deadline = pending.pop(reply.request_id, None)
                if deadline is None:
                    continue  # not ours, or answered already
                elapsed = time.monotonic() - started
                outcomes[reply.request_id] = (self._verdict(reply, elapsed) if started + elapsed <= deadline
                                              else self._late(deadline - started, elapsed))
                if not pending:
                    break
        except grpc.RpcError as e:
            elapsed = time.monotonic() - started
            for request_id, deadline in pending.items():
                outcomes[request_id] = (self._late(deadline - started, elapsed)
                                        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else
                                        Outcome.failed(REMOTE, f"{self.entry.name} at {self.entry.endpoint}: "
                                                       f"{e.code().name} {e.details()}", elapsed))
            pending = {}
        finally:
            if call is not None:
                call.cancel()  # every answer is in (or the call failed): free the stream at once
        elapsed = time.monotonic() - started
        for request_id in pending:
            outcomes[request_id] = Outcome.failed(REMOTE, f"{self.entry.name} closed the stream without answering",
                                                  elapsed)
        return outcomes

    def _late(self, timeout: float, elapsed: float) -> Outcome:
        return Outcome.failed(TIMEOUT, f"{self.entry.name} gave no verdict within {timeout:.3g} s", elapsed)

    def _verdict(self, reply: verifier_pb2.VerifyResponse, elapsed: float) -> Outcome:
        if reply.error:
            return Outcome.failed(REMOTE, f"{self.entry.name}: {reply.error}"[:500], elapsed)
        if not math.isfinite(reply.score):
            return Outcome.failed(NON_FINITE, f"{self.entry.name} returned {reply.score!r}", elapsed)
        return Outcome(score=reply.score, latency_s=elapsed)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for item in queued:
            item.future.cancel()  # the verifier's registration changed or the worker stops: nobody runs these
        self._channel.close()


class RemoteVerifiers:
    """The worker's view of the Redis registry: one `RemoteVerifier` per registered, allowed name.

    `sync()` reloads the registry when its revision changed; a background thread calls it every
    `poll_s`, and the servicer calls it at once when a stream names an unknown verifier, so a verifier
    registered a moment ago is usable without waiting for the poll. Entries are untrusted (anyone who can
    write Redis can write them): a malformed one, or one whose endpoint `endpoints` refuses, is logged
    with its key and skipped.

    Args:
        store: the Redis registry (None: no remote verifiers).
        endpoints: the allow-list for verifier endpoints (default: loopback only).
        local_names: built-in and plugin names, which a registration may not take.
        poll_s: seconds between registry polls (without `start=False`, a thread polls).
    """

    def __init__(self, store: VerifierStore | None, *, endpoints: EndpointPolicy | None = None,
                 local_names: frozenset[str] = frozenset(), poll_s: float = 1.0, poll: bool = True) -> None:
        self._store = store
        self._endpoints = endpoints or EndpointPolicy.parse("loopback")
        self._local_names = set(local_names)
        self._refused: dict[str, RemoteVerifierEntry] = {}
        self._clients: dict[str, RemoteVerifier] = {}
        self._revision = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self.sync()
        if store is not None and poll:
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), name="verifier-registry-poll",
                                            daemon=True)
            self._thread.start()

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self.sync()

    def sync(self, force: bool = False) -> None:
        """Reloads the registrations if they changed (or always with `force`).

        Redis errors are logged, not raised: the worker keeps the registrations it has.
        """
        if self._store is None:
            return
        try:
            self._sync(force)
        except redis.RedisError as e:
            logger.warning("could not reload remote verifiers from Redis: %s", e)

    def _sync(self, force: bool) -> None:
        revision = self._store.revision()
        with self._lock:
            if revision == self._revision and not force:
                return
            entries = {name: entry for name, entry in self._store.entries(self._local_names).items()
                       if self._allowed(entry)}
            for name in list(self._clients):
                if entries.get(name) != self._clients[name].entry:
                    self._clients.pop(name).close()
            for name, entry in entries.items():
                if name not in self._clients:
                    self._clients[name] = RemoteVerifier(entry)
                    logger.info("remote verifier %s v%s at %s is now in use", name, entry.version, entry.endpoint)
            self._revision = revision

    def _allowed(self, entry: RemoteVerifierEntry) -> bool:
        try:
            self._endpoints.check(entry.endpoint)
        except EndpointRefusedError as e:
            if self._refused.get(entry.name) != entry:  # once per entry, not on every reload
                logger.warning("skipping the registered verifier %s: %s", entry.name, e)
            self._refused[entry.name] = entry
            return False
        return True

    def get(self, name: str) -> RemoteVerifier | None:
        with self._lock:
            return self._clients.get(name)

    def entries(self) -> list[RemoteVerifierEntry]:
        with self._lock:
            return [client.entry for _, client in sorted(self._clients.items())]

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
