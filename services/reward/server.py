"""The `rlfabric.v1.Reward` servicer: protos in, pool/remote verifications out, nothing else.

`Score` (one sample per message) and `ScoreBatches` (several per message, the same semantics) read the
request stream in a helper thread, start every sample's verifications as soon as it
arrives (built-ins in the process pool, registered names through `remote.py`) and yields each
`ScoreResponse` when the sample's last verification ends, so responses come in completion order
(`ScoreBatches` sends the responses that are ready together in one message). A failed
verification is a 0 score with an error inside the response; only a malformed request (unknown verifier,
empty sample id) ends the stream, with INVALID_ARGUMENT.
"""

import functools
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import redis

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.reward import metrics
from services.reward.outcome import Outcome
from services.reward.pool import SampleClock, VerifierPool
from services.reward.remote import RemoteVerifiers
from services.reward.rewards import OverlongConfig, overlong_penalty
from services.reward.verifier_store import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_TIMEOUT_S,
    RemoteVerifierEntry,
    VerifierStore,
    validate_entry,
)
from services.reward.verifiers.registry import BUILTIN_VERSION, VERIFIERS

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Reward"
AUTH_METHODS = frozenset({"/rlfabric.v1.Reward/RegisterVerifier", "/rlfabric.v1.Reward/UnregisterVerifier"})


@dataclass(frozen=True)
class _StreamError:
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class _InputEnded:
    samples: int


_CANCELLED = object()
# Most responses one ScoreResponseBatch carries (what was ready together, up to this).
_MAX_RESPONSES_PER_BATCH = 256


class _Stream:
    """The verifications still pending for one Score stream, so that a cancelled stream drops them."""

    def __init__(self) -> None:
        self.cancelled = False
        self._futures: set[Future] = set()
        self._lock = threading.Lock()

    def track(self, future: Future) -> None:
        with self._lock:
            if self.cancelled:
                future.cancel()
            else:
                self._futures.add(future)

    def forget(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            futures, self._futures = list(self._futures), set()
        for future in futures:
            future.cancel()  # only queued ones stop; running ones finish and are dropped


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Scores samples with the pool's verifiers and the registered remote ones.

    Args:
        pool: the process pool running built-in and plugin verifiers.
        worker_id: recorded in every response (provenance).
        remote: registered remote verifiers (None: built-ins only).
        store: the Redis registry for Register/Unregister (None: registration is refused).
        default_deadline_s: per-sample deadline when a request leaves `deadline_s` at 0.
        default_verifier: used when a request names no verifier.
        overlong: DAPO overlong shaping applied to `reward` (None: off).
    """

    def __init__(self, pool: VerifierPool, *, worker_id: str, remote: RemoteVerifiers | None = None,
                 store: VerifierStore | None = None, default_deadline_s: float = 10.0,
                 default_verifier: str = "math_equiv", overlong: OverlongConfig | None = None) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._remote = remote or RemoteVerifiers(None)
        self._store = store
        self._default_deadline_s = default_deadline_s
        self._default_verifiers = [reward_pb2.VerifierSpec(name=default_verifier, weight=1.0)]
        self._overlong = overlong
        self._local_names = set(pool.names)

    # -- Score ------------------------------------------------------------------------------------

    def Score(self, request_iterator: Iterator[reward_pb2.ScoreRequest],
              context: grpc.ServicerContext) -> Iterator[reward_pb2.ScoreResponse]:
        for responses in self._serve(request_iterator, context):
            yield from responses

    def ScoreBatches(self, request_iterator: Iterator[reward_pb2.ScoreRequestBatch],
                     context: grpc.ServicerContext) -> Iterator[reward_pb2.ScoreResponseBatch]:
        requests = (request for batch in request_iterator for request in batch.requests)
        for responses in self._serve(requests, context):
            yield reward_pb2.ScoreResponseBatch(responses=responses)

    def _serve(self, requests: Iterator[reward_pb2.ScoreRequest],
               context: grpc.ServicerContext) -> Iterator[list[reward_pb2.ScoreResponse]]:
        """The responses of one stream, in completion order, grouped as they were ready together."""
        results: queue.SimpleQueue = queue.SimpleQueue()
        stream = _Stream()

        def on_rpc_done() -> None:
            stream.cancel()
            results.put(_CANCELLED)  # wake the handler; it must not wait for answers nobody reads

        context.add_callback(on_rpc_done)
        reader = threading.Thread(target=self._read, args=(requests, results, stream),
                                  name="reward-score-reader", daemon=True)
        reader.start()
        answered, expected = 0, None
        while expected is None or answered < expected:
            ready = [results.get()]
            while len(ready) < _MAX_RESPONSES_PER_BATCH:
                try:
                    ready.append(results.get_nowait())
                except queue.Empty:
                    break
            responses = []
            for item in ready:
                if item is _CANCELLED:
                    return
                if isinstance(item, _StreamError):
                    if responses:
                        yield responses  # answers that were ready before the bad request still count
                    stream.cancel()
                    context.abort(item.code, item.message)
                if isinstance(item, _InputEnded):
                    expected = item.samples
                    continue
                responses.append(item)
            if responses:
                answered += len(responses)
                yield responses

    def _read(self, request_iterator: Iterator[reward_pb2.ScoreRequest], results: queue.SimpleQueue,
              stream: "_Stream") -> None:
        samples = 0
        try:
            for request in request_iterator:
                if stream.cancelled:
                    return
                problem = self._check(request)
                if problem is not None:
                    results.put(_StreamError(grpc.StatusCode.INVALID_ARGUMENT, problem))
                    return
                self._start_sample(request, results, stream)
                samples += 1
        except grpc.RpcError:
            return  # the client went away; its samples are abandoned
        except Exception as e:  # noqa: BLE001 (report instead of hanging the stream)
            logger.exception("Score stream failed")
            results.put(_StreamError(grpc.StatusCode.INTERNAL, f"reward worker {self._worker_id}: {e}"))
            return
        results.put(_InputEnded(samples))

    def _check(self, request: reward_pb2.ScoreRequest) -> str | None:
        if not request.sample_id:
            return "ScoreRequest.sample_id is empty: every sample needs an id (responses are keyed by it)"
        for spec in request.verifiers:
            if spec.name in self._local_names or self._remote.get(spec.name) is not None:
                continue
            self._remote.sync(force=True)  # registered a moment ago, before our poll saw it?
            if self._remote.get(spec.name) is None:
                known = sorted(self._local_names) + [e.name for e in self._remote.entries()]
                return (f"sample {request.sample_id!r}: unknown verifier {spec.name!r}; known verifiers: "
                        f"{', '.join(known)}")
        return None

    def _start_sample(self, request: reward_pb2.ScoreRequest, results: queue.SimpleQueue,
                      stream: "_Stream") -> None:
        specs = list(request.verifiers) or self._default_verifiers
        clock = SampleClock(request.deadline_s if request.deadline_s > 0 else self._default_deadline_s)
        metrics.IN_FLIGHT_SAMPLES.inc()
        versions: list[str] = []
        outcomes: list[Outcome | None] = [None] * len(specs)
        pending = [len(specs)]
        lock = threading.Lock() if len(specs) > 1 else None
        given_up = [False]

        def finished(index: int, outcome: Outcome | None) -> None:
            # Called once per verification, from a pool thread or a remote call's thread.
            if outcome is None:
                given_up[0] = True  # the stream was cancelled before it ran
            outcomes[index] = outcome
            if lock is not None:
                with lock:
                    pending[0] -= 1
                    if pending[0]:
                        return
            if given_up[0] or stream.cancelled:
                metrics.IN_FLIGHT_SAMPLES.dec()
                return  # the stream is gone; nobody reads this answer
            results.put(self._response(request, specs, versions, outcomes))

        def not_cancelled() -> bool:
            return not stream.cancelled

        remotes = [None if spec.name in self._local_names else self._remote.get(spec.name) for spec in specs]
        # Every version is known before the first verification starts (a fast one may finish at once).
        versions.extend(BUILTIN_VERSION if remote is None else remote.entry.version for remote in remotes)
        for index, (spec, remote) in enumerate(zip(specs, remotes, strict=True)):
            if remote is None:
                self._pool.submit_callback(spec.name, request.response, request.ground_truth, clock,
                                           functools.partial(finished, index), not_cancelled)
                continue
            future = remote.submit(request.sample_id, request.response, request.ground_truth, request.prompt,
                                   clock)
            stream.track(future)

            def remote_done(done: Future, index: int = index) -> None:
                stream.forget(done)
                finished(index, None if done.cancelled() else done.result())

            future.add_done_callback(remote_done)

    def _response(self, request: reward_pb2.ScoreRequest, specs: list[reward_pb2.VerifierSpec],
                  versions: list[str], outcomes: list[Outcome]) -> reward_pb2.ScoreResponse:
        metrics.IN_FLIGHT_SAMPLES.dec()
        response = reward_pb2.ScoreResponse(sample_id=request.sample_id, worker_id=self._worker_id)
        reward = 0.0
        for spec, version, outcome in zip(specs, versions, outcomes, strict=True):
            metrics.record_outcome(spec.name, outcome.latency_s, outcome.reason)
            response.scores.add(verifier=spec.name, version=version, score=outcome.score, error=outcome.error,
                                latency_s=outcome.latency_s)
            reward += spec.weight * outcome.score
        if self._overlong is not None and request.response_length > 0:
            reward += overlong_penalty(request.response_length, self._overlong)
        response.reward = reward
        return response

    # -- registry RPCs ----------------------------------------------------------------------------

    def ListVerifiers(self, request: reward_pb2.ListVerifiersRequest,
                      context: grpc.ServicerContext) -> reward_pb2.ListVerifiersResponse:
        reply = reward_pb2.ListVerifiersResponse()
        for name, entry in VERIFIERS.items():
            reply.verifiers.add(name=name, version=BUILTIN_VERSION, builtin=True, description=entry.description)
        for name, spec in self._pool.plugins.items():
            reply.verifiers.add(name=name, version=BUILTIN_VERSION, builtin=True, description=f"plugin {spec}")
        self._remote.sync()
        for entry in self._remote.entries():
            reply.verifiers.add(name=entry.name, version=entry.version, builtin=False, endpoint=entry.endpoint,
                                description=entry.description)
        return reply

    def RegisterVerifier(self, request: reward_pb2.RegisterVerifierRequest,
                         context: grpc.ServicerContext) -> reward_pb2.RegisterVerifierResponse:
        store = self._require_store(context)
        entry = RemoteVerifierEntry(
            name=request.name, version=request.version, endpoint=request.endpoint,
            timeout_s=request.timeout_s or DEFAULT_TIMEOUT_S,
            max_concurrency=request.max_concurrency or DEFAULT_MAX_CONCURRENCY, description=request.description,
        )
        try:
            validate_entry(entry, self._local_names)
        except KeyError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e.args[0]))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RegisterVerifier: {e}")
        try:
            store.register(entry)
        except redis.RedisError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the verifier registry (Redis) is unreachable: {e}")
        self._remote.sync()
        logger.info("registered remote verifier %s v%s at %s", entry.name, entry.version, entry.endpoint)
        return reward_pb2.RegisterVerifierResponse(verifier=reward_pb2.VerifierInfo(
            name=entry.name, version=entry.version, builtin=False, endpoint=entry.endpoint,
            description=entry.description))

    def UnregisterVerifier(self, request: reward_pb2.UnregisterVerifierRequest,
                           context: grpc.ServicerContext) -> reward_pb2.UnregisterVerifierResponse:
        store = self._require_store(context)
        try:
            removed = store.unregister(request.name)
        except redis.RedisError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the verifier registry (Redis) is unreachable: {e}")
        if not removed:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no registered verifier named {request.name!r}")
        self._remote.sync()
        logger.info("unregistered remote verifier %s", request.name)
        return reward_pb2.UnregisterVerifierResponse()

    def _require_store(self, context: grpc.ServicerContext) -> VerifierStore:
        if self._store is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this reward worker runs without Redis (--redis-url), so it cannot register verifiers")
        return self._store
