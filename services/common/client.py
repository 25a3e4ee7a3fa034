"""gRPC client helpers: channels with message limits, keepalive, a retry policy, and auth metadata."""

from __future__ import annotations

import functools
import json
from typing import Any

import grpc

from rlfabric.v1 import coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2, verifier_pb2
from services.common.credentials import client_credentials
from services.common.wire_limits import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MAX_MESSAGE_BYTES


def _unary_methods() -> list[dict[str, str]]:
    """Every unary rpc of the rlfabric.v1 services, as service-config method names."""
    names = []
    for module in (coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2, verifier_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            names += [{"service": service.full_name, "method": m.name} for m in service.methods
                      if not m.client_streaming and not m.server_streaming]
    return names


@functools.cache
def _service_config() -> str:
    """Transparent retries of UNAVAILABLE (the call never reached a handler), for unary rpcs only.

    Streaming rpcs get no retry policy: with one, grpc-core keeps a stream whose server died before its first
    reply waiting for a retry that never comes, past its deadline (a SIGKILLed server hung the caller for good,
    tests/common/test_client_liveness.py). A failed stream fails at once; callers re-send idempotent work
    (sample ids make that safe).
    """
    return json.dumps({"methodConfig": [{
        "name": _unary_methods(),
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]})


class _TokenAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context, callback):
        callback((("authorization", f"Bearer {self._token}"),), None)


class _MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call (plaintext channels cannot carry call credentials)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel_options() -> list[tuple[str, object]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # grpc-core 1.85 times keepalive pings out with this (60 s by default), not keepalive_timeout_ms alone.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Keep pinging a silent connection (the default stops after two pings without data, and a long
        # Generate or Update call can stay silent far longer than that).
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _service_config()),
    ]


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (for plaintext channels, where call credentials are refused)."""
    return (("authorization", f"Bearer {token}"),)


# Passed for `token` / `tls_ca`: this process's (services/common/credentials.py).
INHERIT: Any = object()


def make_channel(target: str, *, token: str | None = INHERIT, tls_ca: str | None = INHERIT) -> grpc.Channel:
    """A channel to `target` ("host:port", or "dns:///name:port" for round-robin over a headless service).

    With a `token`, every call carries `authorization: Bearer <token>` (as call credentials over TLS, as
    plain metadata over a plaintext channel). Unless given, `token` and `tls_ca` are this process's
    (credentials.py); pass None explicitly for a channel to a peer that must not see them (a user's verifier).
    """
    own = client_credentials()
    token = own.token if token is INHERIT else token
    tls_ca = own.tls_ca if tls_ca is INHERIT else tls_ca
    options = channel_options()
    if target.startswith("dns:///"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if tls_ca is None:
        channel = grpc.insecure_channel(target, options=options)
        return grpc.intercept_channel(channel, _MetadataInterceptor(auth_metadata(token))) if token else channel
    with open(tls_ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_TokenAuth(token)))
    return grpc.secure_channel(target, creds, options=options)


def raw_channel(target: str, options: list[tuple[str, object]]) -> grpc.Channel:
    """A channel with the caller's own options, plaintext or TLS after this process's CA (no token added)."""
    tls_ca = client_credentials().tls_ca
    if tls_ca is None:
        return grpc.insecure_channel(target, options=options)
    with open(tls_ca, "rb") as f:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=f.read()), options=options)
