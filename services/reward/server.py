"""The `rlfabric.v1.Reward` servicer: protos in, pool/remote verifications out, nothing else.

`Score` runs one stream through `scoring.py` and yields the answers that are ready together as one
`ScoreResponseBatch`. The registry RPCs read and write the Redis registry (`verifier_store.py`) after
checking the entry and its endpoint (`endpoints.py`). Requests are parsed with `wire.lenient`, so a
message protobuf refuses (a string that is not UTF-8) is INVALID_ARGUMENT naming the field, not INTERNAL.
"""

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc
import redis

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.status import abort, echo
from services.reward.endpoints import EndpointPolicy, EndpointRefusedError
from services.reward.pool import VerifierPool
from services.reward.remote import RemoteVerifiers
from services.reward.scoring import CANCELLED, InputEnded, Scorer, StreamError, StreamState
from services.reward.verifier_store import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_TIMEOUT_S,
    RemoteVerifierEntry,
    VerifierStore,
    validate_entry,
)
from services.reward.verifiers.registry import BUILTIN_VERSION, VERIFIERS
from services.reward.wire import Undecodable, lenient

logger = logging.getLogger(__name__)

SERVICE_NAME = "rlfabric.v1.Reward"
AUTH_METHODS = frozenset({"/rlfabric.v1.Reward/RegisterVerifier", "/rlfabric.v1.Reward/UnregisterVerifier"})
# Most responses one ScoreResponseBatch carries (what was ready together, up to this).
_MAX_RESPONSES_PER_BATCH = 256


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Scores samples with the pool's verifiers and the registered remote ones.

    Args:
        pool: the process pool running built-in and plugin verifiers.
        worker_id: recorded in every response (provenance).
        remote: registered remote verifiers (None: built-ins only).
        store: the Redis registry for Register/Unregister (None: registration is refused).
        endpoints: which verifier endpoints RegisterVerifier accepts (default: loopback only).
        default_deadline_s: per-sample deadline when a request leaves `deadline_s` at 0.
    """

    def __init__(self, pool: VerifierPool, *, worker_id: str, remote: RemoteVerifiers | None = None,
                 store: VerifierStore | None = None, endpoints: EndpointPolicy | None = None,
                 default_deadline_s: float = 10.0) -> None:
        self._pool = pool
        self._remote = remote or RemoteVerifiers(None)
        self._store = store
        self._endpoints = endpoints or EndpointPolicy.parse("loopback")
        self._scorer = Scorer(pool, self._remote, worker_id=worker_id, default_deadline_s=default_deadline_s)

    def Score(self, request_iterator: Iterator[reward_pb2.ScoreRequestBatch | Undecodable],
              context: grpc.ServicerContext) -> Iterator[reward_pb2.ScoreResponseBatch]:
        results: queue.SimpleQueue = queue.SimpleQueue()
        stream = StreamState()

        def on_rpc_done() -> None:
            stream.cancel()
            results.put(CANCELLED)  # wake the handler; it must not wait for answers nobody reads

        context.add_callback(on_rpc_done)
        threading.Thread(target=self._scorer.read, args=(request_iterator, results, stream),
                         name="reward-score-reader", daemon=True).start()
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
                if item is CANCELLED:
                    return
                if isinstance(item, StreamError):
                    if responses:
                        yield reward_pb2.ScoreResponseBatch(responses=responses)  # ready before the bad one
                    stream.cancel()
                    abort(context, item.code, item.message)
                if isinstance(item, InputEnded):
                    expected = item.samples
                    continue
                responses.append(item)
            if responses:
                answered += len(responses)
                yield reward_pb2.ScoreResponseBatch(responses=responses)

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
            validate_entry(entry, set(self._pool.names))
            self._endpoints.check(entry.endpoint)
        except KeyError as e:
            abort(context, grpc.StatusCode.ALREADY_EXISTS, str(e.args[0]))
        except EndpointRefusedError as e:
            abort(context, grpc.StatusCode.PERMISSION_DENIED, f"RegisterVerifier: {e}")
        except ValueError as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"RegisterVerifier: {e}")
        try:
            store.register(entry)
        except redis.RedisError as e:
            abort(context, grpc.StatusCode.UNAVAILABLE, f"the verifier registry (Redis) is unreachable: {e}")
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
            abort(context, grpc.StatusCode.UNAVAILABLE, f"the verifier registry (Redis) is unreachable: {e}")
        if not removed:
            abort(context, grpc.StatusCode.NOT_FOUND, f"no registered verifier named {echo(request.name)}")
        self._remote.sync()
        logger.info("unregistered remote verifier %s", request.name)
        return reward_pb2.UnregisterVerifierResponse()

    def _require_store(self, context: grpc.ServicerContext) -> VerifierStore:
        if self._store is None:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                          "this reward worker runs without Redis (--redis-url), so it cannot register verifiers")
        return self._store


def _unary(method: Callable, request_class: type, response_class: type) -> grpc.RpcMethodHandler:
    def handle(request: object, context: grpc.ServicerContext) -> object:
        if isinstance(request, Undecodable):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.problem)
        return method(request, context)

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=lenient(request_class),
                                               response_serializer=response_class.SerializeToString)


def add_to_server(servicer: RewardServicer, server: grpc.Server) -> None:
    """Mounts `servicer` like the generated `add_RewardServicer_to_server`, with lenient request parsing."""
    handlers = {
        "Score": grpc.stream_stream_rpc_method_handler(
            servicer.Score, request_deserializer=lenient(reward_pb2.ScoreRequestBatch),
            response_serializer=reward_pb2.ScoreResponseBatch.SerializeToString),
        "ListVerifiers": _unary(servicer.ListVerifiers, reward_pb2.ListVerifiersRequest,
                                reward_pb2.ListVerifiersResponse),
        "RegisterVerifier": _unary(servicer.RegisterVerifier, reward_pb2.RegisterVerifierRequest,
                                   reward_pb2.RegisterVerifierResponse),
        "UnregisterVerifier": _unary(servicer.UnregisterVerifier, reward_pb2.UnregisterVerifierRequest,
                                     reward_pb2.UnregisterVerifierResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
