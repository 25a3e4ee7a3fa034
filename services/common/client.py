"""gRPC client helpers: channels with message limits, keepalive, a retry policy, and auth metadata."""

from __future__ import annotations

import json

import grpc

from services.common.server import MAX_MESSAGE_BYTES

DEFAULT_DEADLINE_S = 30.0

# Transparent retries for calls that never reached a handler (UNAVAILABLE). Streaming calls are only
# retried before the first response, which gRPC guarantees; callers re-send idempotent work themselves.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "rlfabric.v1.Rollout"}, {"service": "rlfabric.v1.Trainer"},
                         {"service": "rlfabric.v1.Reward"}, {"service": "rlfabric.v1.Verifier"},
                         {"service": "rlfabric.v1.Coordinator"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class _TokenAuth(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context, callback):  # noqa: ANN001 (grpc signature)
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

    def _details(self, details):  # noqa: ANN001
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001
        return continuation(self._details(details), request_iterator)


def channel_options() -> list[tuple[str, object]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
    ]


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (for plaintext channels, where call credentials are refused)."""
    return (("authorization", f"Bearer {token}"),)


def make_channel(target: str, *, token: str | None = None, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to `target` ("host:port", or "dns:///name:port" for round-robin over a headless service).

    With a `token`, every call carries `authorization: Bearer <token>` (as call credentials over TLS, as
    plain metadata over a plaintext loopback channel).
    """
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
