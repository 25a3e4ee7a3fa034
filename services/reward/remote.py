"""Calls to registered remote verifiers: deadlines, bounded concurrency and a circuit breaker.

Each call is one short `Verifier.Verify` stream carrying one request, with a gRPC deadline of the
verifier's `timeout_s` (capped by the sample's deadline). At most `max_concurrency` calls run at once per
verifier and worker (a thread pool of that size). After `failure_threshold` consecutive failures the
circuit opens: calls fail at once with `circuit_open` for `cooldown_s`, then one trial call decides
whether it closes again. A failure costs the sample a 0 score with the reason; never the stream.
"""

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

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

    def submit(self, request_id: str, response: str, ground_truth: str, prompt: str,
               clock: SampleClock) -> "Future[Outcome]":
        """Queues one call; the future always resolves to an Outcome."""
        return self._executor.submit(self._call, request_id, response, ground_truth, prompt, clock)

    def _call(self, request_id: str, response: str, ground_truth: str, prompt: str,
              clock: SampleClock) -> Outcome:
        name = self.entry.name
        started = time.monotonic()
        timeout = min(self.entry.timeout_s, clock.deadline() - started)
        if timeout <= 0:
            return Outcome.failed(TIMEOUT, "the sample's deadline passed before the call started", 0.0)
        if not self.breaker.allow():
            metrics.REMOTE_CIRCUIT_OPEN.labels(name).set(1)
            return Outcome.failed(CIRCUIT_OPEN, f"{name} at {self.entry.endpoint} failed repeatedly; "
                                  f"retrying after {self.breaker.cooldown_s:g} s", 0.0)
        request = verifier_pb2.VerifyRequest(request_id=request_id, response=response,
                                             ground_truth=ground_truth, prompt=prompt)
        outcome = self._exchange(request, timeout, started)
        self.breaker.record(not outcome.reason)
        metrics.REMOTE_CIRCUIT_OPEN.labels(name).set(1 if self.breaker.is_open else 0)
        return outcome

    def _exchange(self, request: verifier_pb2.VerifyRequest, timeout: float, started: float) -> Outcome:
        call = None
        try:
            call = self._stub.Verify(iter([request]), timeout=timeout)
            reply = next((r for r in call if r.request_id == request.request_id), None)
        except grpc.RpcError as e:
            elapsed = time.monotonic() - started
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Outcome.failed(TIMEOUT, f"{self.entry.name} gave no verdict within {timeout:.3g} s", elapsed)
            return Outcome.failed(REMOTE, f"{self.entry.name} at {self.entry.endpoint}: {e.code().name} {e.details()}",
                                  elapsed)
        finally:
            if call is not None:
                call.cancel()  # one answer is all we wait for; free the stream at once
        elapsed = time.monotonic() - started
        if reply is None:
            return Outcome.failed(REMOTE, f"{self.entry.name} closed the stream without answering", elapsed)
        if reply.error:
            return Outcome.failed(REMOTE, f"{self.entry.name}: {reply.error}"[:500], elapsed)
        if not math.isfinite(reply.score):
            return Outcome.failed(NON_FINITE, f"{self.entry.name} returned {reply.score!r}", elapsed)
        return Outcome(score=reply.score, latency_s=elapsed)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
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
