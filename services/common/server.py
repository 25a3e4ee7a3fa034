"""gRPC server bootstrap shared by every service.

`create_server` adds what every rlfabric server must expose: the standard `grpc.health.v1` service, server
reflection (so `grpcurl` and `grpc_health_probe` work), a Prometheus `/metrics` endpoint, large message
limits for tensor buckets, optional TLS, and a bearer-token interceptor for privileged methods.
Tests bind port 0 and read the chosen ports back.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.credentials import (
    GUARDED_METHODS,
    TlsConfig,
    guarded,
    server_credentials,
)
from services.common.status import abort, echo
from services.common.stop_signal import wait_for_stop_signal
from services.common.wire_limits import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Clients ping every KEEPALIVE_TIME_MS of silence; allow twice that rate without a GOAWAY ("too_many_pings").
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
    # The server pings silent clients too, so the calls of a dead caller (a killed coordinator) end within
    # about 15 s instead of holding their handler threads and engine work for hours.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class ServiceSpec:
    """One servicer to mount: `add_fn(servicer, server)` is the generated `add_XServicer_to_server`."""

    add_fn: Callable[[Any, grpc.Server], None]
    servicer: Any
    name: str


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on the given methods (all methods when `methods` is None)."""

    _EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

    def __init__(self, token: str, methods: Collection[str] | None = None, refusal: str | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._methods = frozenset(methods) if methods is not None else None
        self._refusal = refusal  # the message instead of the default (a server whose token nobody knows)

    def _guarded(self, method: str) -> bool:
        if method.startswith(self._EXEMPT_PREFIXES):
            return False
        return self._methods is None or method in self._methods

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self._guarded(method):
            return continuation(handler_call_details)
        supplied = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(supplied.encode(), self._expected):
            return continuation(handler_call_details)
        return _abort_handler(
            continuation(handler_call_details),
            grpc.StatusCode.UNAUTHENTICATED,
            f"{echo(method)}: {self._refusal}" if self._refusal else
            f"{echo(method)} requires 'authorization: Bearer <token>' metadata with the server's token",
        )


def _abort_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str):
    def deny(_request, context):
        abort(context, code, message)

    if handler is None or (not handler.request_streaming and not handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_stream_rpc_method_handler(deny)


# How long stop() waits, past its grace, for the cancelled calls to end. gRPC can keep a call open for good: after
# the rollout fuzzing, two Generate calls (client half-closed, no handler running) kept a send-status op that
# never completed, even after the cancellation, and the unbounded wait hung the test teardown (docs/reliability.md).
STOP_WAIT_S = 10.0


class ServiceServer:
    """A started-or-startable gRPC server with health, reflection and metrics attached."""

    def __init__(self, server: grpc.Server, port: int, host: str, health_servicer: health.HealthServicer,
                 names: Sequence[str], metrics_port: int | None, component: str) -> None:
        self.server = server
        self.port = port
        self.host = host
        self.metrics_port = metrics_port
        self.component = component
        self._health = health_servicer
        self._names = list(names)
        self._metrics_server: Any = None
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> ServiceServer:
        if self.metrics_port is not None:
            self._metrics_server, port = _start_metrics_http(self.metrics_port)
            self.metrics_port = port
        self.server.start()
        self.set_serving(True)
        logger.info("%s serving on %s (metrics on :%s)", self.component, self.address, self.metrics_port)
        return self

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._names]:
            self._health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> bool:
        """Stops accepting calls, lets in-flight calls finish for `grace_s`, then cancels them; waits at most
        STOP_WAIT_S more for them to end. True when every call ended."""
        if self._stopped.is_set():
            return True
        self._stopped.set()
        self.set_serving(False)
        ended = self.server.stop(grace_s).wait(timeout=grace_s + STOP_WAIT_S)
        if not ended:
            logger.warning("%s: calls still open %.0f s after the stop's grace; stopping without them",
                           self.component, STOP_WAIT_S)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        logger.info("%s stopped", self.component)
        return ended

    def wait(self) -> None:
        self.server.wait_for_termination()


# Passed for `auth_token` / `auth_methods` / `tls`: this process's (services/common/credentials.py).
INHERIT: Any = object()


def _default_methods(names: Sequence[str]) -> Collection[str] | None:
    """The guarded methods of the mounted services (credentials.GUARDED_METHODS); None (all) for unknown ones."""
    if not names or any(n not in GUARDED_METHODS for n in names):
        return None
    return frozenset().union(*(guarded(n) for n in names))


def create_server(
    specs: Sequence[ServiceSpec],
    address: str = "127.0.0.1:0",
    *,
    component: str,
    metrics_port: int | None = 0,
    auth_token: str | None = INHERIT,
    auth_methods: Collection[str] | None = INHERIT,
    tls: TlsConfig | None = INHERIT,
    max_workers: int = 16,
) -> ServiceServer:
    """Builds (but does not start) a server hosting `specs` plus health and reflection.

    Args:
        specs: servicers to mount.
        address: "host:port"; port 0 picks a free port (read it from `.port`).
        component: service name used in logs.
        metrics_port: Prometheus HTTP port; 0 picks a free one; None disables it.
        auth_token: when set, `auth_methods` (or every non-health method when None) need the token.
            Default: this process's (credentials.py), on the services' GUARDED_METHODS.
        tls: serve TLS instead of plaintext. Default: this process's (credentials.py).
        max_workers: handler threads (each streaming call holds one for its lifetime).
    """
    names = [s.name for s in specs]
    own = server_credentials()
    refusal = own.refusal if auth_token is INHERIT else None
    auth_token = own.token if auth_token is INHERIT else auth_token
    auth_methods = _default_methods(names) if auth_methods is INHERIT else auth_methods
    tls = own.tls if tls is INHERIT else tls
    interceptors = [TokenAuthInterceptor(auth_token, auth_methods, refusal)] if auth_token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=component),
        interceptors=interceptors,
        options=GRPC_OPTIONS,
    )
    for spec in specs:
        spec.add_fn(spec.servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"{component}: could not bind {address}")
    host = address.rsplit(":", 1)[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]"):
        host = "127.0.0.1"
    return ServiceServer(server, port, host, health_servicer, names, metrics_port, component)


def _start_metrics_http(port: int) -> tuple[Any, int]:
    from prometheus_client import start_http_server

    httpd, _thread = start_http_server(port, addr="127.0.0.1" if port == 0 else "0.0.0.0")
    return httpd, httpd.server_address[1]


def serve_until_signal(server: ServiceServer, grace_s: float = 10.0) -> None:
    """Blocks until SIGTERM/SIGINT, then drains: NOT_SERVING first, in-flight calls get `grace_s`."""
    received = wait_for_stop_signal()
    logger.info("%s received %s, draining", server.component, received.name)
    server.stop(grace_s)
