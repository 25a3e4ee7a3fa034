"""One `Reward.Score` stream on a worker: check each sample, start its verifications, answer when they end.

A reader thread takes the request batches as they arrive and starts every sample's verifications at once
(built-ins and plugins in the process pool, registered names through `remote.py`); each sample's
`ScoreResponse` is queued when its last verification ends, so answers come in completion order. A
malformed sample (see `sample_problem`) ends the stream with INVALID_ARGUMENT; a failed verification is
a 0 score with an error inside the response.
"""

import functools
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from rlfabric.v1 import reward_pb2
from services.common.status import echo
from services.reward import metrics
from services.reward.outcome import Outcome
from services.reward.pool import SampleClock, VerifierPool
from services.reward.remote import RemoteVerifiers
from services.reward.rewards import weighted_reward
from services.reward.verifiers.registry import BUILTIN_VERSION
from services.reward.wire import Undecodable

logger = logging.getLogger(__name__)

# The longest a sample may ask for (`ScoreRequest.deadline_s`): verifications are seconds, not hours,
# and a larger value is almost always a unit mistake or an attack on the pool's timers.
MAX_DEADLINE_S = 3600.0


EMPTY_BATCH = ("ScoreRequestBatch.requests is empty: every batch carries at least one ScoreRequest (a client "
               "built from an older reward.proto puts its samples in fields this worker does not read)")


@dataclass(frozen=True)
class StreamError:
    """Ends the stream with `code` (queued after the answers that were ready before it)."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class InputEnded:
    """The client closed its side after `samples` samples."""

    samples: int


CANCELLED = object()  # queued when the RPC ends early, so the handler stops waiting


def sample_problem(request: reward_pb2.ScoreRequest, is_known: Callable[[str], bool],
                   known_names: Callable[[], list[str]]) -> str | None:
    """Why `request` cannot be scored (the field named), or None when it can."""
    sample = f"sample {echo(request.sample_id)}"
    if not request.sample_id:
        return "ScoreRequest.sample_id is empty: every sample needs an id (responses are keyed by it)"
    if not request.verifiers:
        return (f"{sample}: ScoreRequest.verifiers is empty; name at least one verifier with its weight "
                "(a run sends rl_config.verifier_function / verifier_weight)")
    if not math.isfinite(request.deadline_s) or not 0 <= request.deadline_s <= MAX_DEADLINE_S:
        return (f"{sample}: ScoreRequest.deadline_s is {echo(request.deadline_s)}; it must be a finite number of "
                f"seconds in [0, {MAX_DEADLINE_S:g}] (0: the worker's default)")
    for spec in request.verifiers:
        if not math.isfinite(spec.weight):
            return f"{sample}: VerifierSpec.weight of {echo(spec.name)} is {echo(spec.weight)}; weights must be finite"
        if not is_known(spec.name):
            return f"{sample}: unknown verifier {echo(spec.name)}; known verifiers: {', '.join(known_names())}"
    return None


class StreamState:
    """The remote verifications still pending for one stream, so that a cancelled stream drops them."""

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


class Scorer:
    """Starts the verifications of checked samples and builds their responses.

    Args:
        pool: runs built-in and plugin verifiers.
        remote: registered remote verifiers.
        worker_id: recorded in every response (provenance).
        default_deadline_s: per-sample deadline when a request leaves `deadline_s` at 0 (the worker checks
            it is in (0, MAX_DEADLINE_S]).
    """

    def __init__(self, pool: VerifierPool, remote: RemoteVerifiers, *, worker_id: str,
                 default_deadline_s: float) -> None:
        self._pool = pool
        self._remote = remote
        self._worker_id = worker_id
        self._default_deadline_s = default_deadline_s
        self._local_names = set(pool.names)

    def is_known(self, name: str) -> bool:
        if name in self._local_names or self._remote.get(name) is not None:
            return True
        self._remote.sync(force=True)  # registered a moment ago, before our poll saw it?
        return self._remote.get(name) is not None

    def known_names(self) -> list[str]:
        return sorted(self._local_names) + [entry.name for entry in self._remote.entries()]

    def read(self, batches: Iterator[reward_pb2.ScoreRequestBatch | Undecodable], results: queue.SimpleQueue,
             stream: StreamState) -> None:
        """Starts every sample of `batches` (the reader thread's body); ends with InputEnded or StreamError."""
        samples = 0
        try:
            for batch in batches:
                if stream.cancelled:
                    return
                if isinstance(batch, Undecodable):
                    results.put(StreamError(grpc.StatusCode.INVALID_ARGUMENT, batch.problem))
                    return
                if not batch.requests:
                    # What a client built from an older reward.proto sends: its samples sit in fields this
                    # worker does not know. Answering OK with nothing would look like a scored empty batch.
                    results.put(StreamError(grpc.StatusCode.INVALID_ARGUMENT, EMPTY_BATCH))
                    return
                for request in batch.requests:
                    problem = sample_problem(request, self.is_known, self.known_names)
                    if problem is not None:
                        results.put(StreamError(grpc.StatusCode.INVALID_ARGUMENT, problem))
                        return
                    self._start(request, results, stream)
                    samples += 1
        except grpc.RpcError:
            return  # the client went away; its samples are abandoned
        except Exception as e:
            logger.exception("Score stream failed")
            results.put(StreamError(grpc.StatusCode.INTERNAL, f"reward worker {self._worker_id}: {e}"))
            return
        results.put(InputEnded(samples))

    def _start(self, request: reward_pb2.ScoreRequest, results: queue.SimpleQueue, stream: StreamState) -> None:
        specs = list(request.verifiers)
        clock = SampleClock(request.deadline_s or self._default_deadline_s)
        metrics.IN_FLIGHT_SAMPLES.inc()
        outcomes: list[Outcome | None] = [None] * len(specs)
        pending = [len(specs)]
        lock = threading.Lock() if len(specs) > 1 else None
        given_up = [False]
        remotes = [None if spec.name in self._local_names else self._remote.get(spec.name) for spec in specs]
        # Every version is known before the first verification starts (a fast one may finish at once).
        versions = [BUILTIN_VERSION if remote is None else remote.entry.version for remote in remotes]

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
            metrics.IN_FLIGHT_SAMPLES.dec()
            if given_up[0] or stream.cancelled:
                return  # the stream is gone; nobody reads this answer
            results.put(self._response(request, specs, versions, outcomes))

        def not_cancelled() -> bool:
            return not stream.cancelled

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
        response = reward_pb2.ScoreResponse(sample_id=request.sample_id, worker_id=self._worker_id)
        for spec, version, outcome in zip(specs, versions, outcomes, strict=True):
            metrics.record_outcome(spec.name, outcome.latency_s, outcome.reason)
            response.scores.add(verifier=spec.name, version=version, score=outcome.score, error=outcome.error,
                                latency_s=outcome.latency_s)
        response.reward = weighted_reward([o.score for o in outcomes], [spec.weight for spec in specs])
        return response
