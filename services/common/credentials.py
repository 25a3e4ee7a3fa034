"""This process's service credentials: what its servers require and what its calls carry.

`security.py` turns a command's flags into them once (`server_security`, `configure_client`); `server.py`
`create_server` and `client.py` `make_channel` read them whenever their caller passes none, so every server
of a process is protected alike and every service-to-service call carries the same token without each call
site threading it. This module imports nothing of rlfabric, so all three depend on it and none on another.

What each service requires the token on is `GUARDED_METHODS`; docs/security.md says why the rest stay open.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

# Per service, the RPCs that need `authorization: Bearer TOKEN` whenever the server has a token. Everything that
# changes state (weights, versions, checkpoints, runs, the verifier table, engine residency) is here, and so is
# Tool.Call (it runs code or reaches the network on the caller's behalf); what stays open only reads (Info,
# GetRun, StreamMetrics, ListVerifiers, ListTools) or computes on the caller's input without keeping anything
# (Rollout.Generate, Reward.Score). Health and reflection are always open (probes use them).
GUARDED_METHODS: dict[str, frozenset[str]] = {
    "rlfabric.v1.Trainer": frozenset({"ComputeLogProbs", "ComputeValues", "Update", "SaveCheckpoint",
                                      "LoadCheckpoint", "PushWeights", "Offload", "Onload"}),
    "rlfabric.v1.Rollout": frozenset({"UpdateWeights", "Sleep", "Wake"}),
    "rlfabric.v1.Coordinator": frozenset({"StartRun", "StopRun"}),
    "rlfabric.v1.Reward": frozenset({"RegisterVerifier", "UnregisterVerifier"}),
    "rlfabric.v1.Tool": frozenset({"Call"}),
}


def guarded(service: str) -> frozenset[str]:
    """Full method names ("/rlfabric.v1.X/Method") the token guards on `service`."""
    return frozenset(f"/{service}/{m}" for m in GUARDED_METHODS[service])


@dataclass(frozen=True)
class TlsConfig:
    """Server TLS material (PEM file paths). With `client_ca`, clients must present a certificate."""

    cert_chain: str
    private_key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        root = read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(read(self.private_key), read(self.cert_chain))],
            root_certificates=root,
            require_client_auth=root is not None,
        )


@dataclass(frozen=True)
class ServerCredentials:
    """What this process's servers require: a token on their guarded methods (None: nothing guarded), TLS
    (None: plaintext), and the UNAUTHENTICATED message when the token is one nobody knows (fail closed)."""

    token: str | None = None
    tls: TlsConfig | None = None
    refusal: str | None = None


@dataclass(frozen=True)
class ClientCredentials:
    """What this process's calls to other services carry: the token, and the CA their certificates verify
    against (None: plaintext)."""

    token: str | None = None
    tls_ca: str | None = None


_server = ServerCredentials()
_client = ClientCredentials()


def server_credentials() -> ServerCredentials:
    return _server


def set_server_credentials(creds: ServerCredentials) -> ServerCredentials:
    """Makes `creds` what this process's servers require from now on; returns the previous ones."""
    global _server
    previous, _server = _server, creds
    return previous


def client_credentials() -> ClientCredentials:
    return _client


def set_client_credentials(creds: ClientCredentials) -> ClientCredentials:
    """Makes `creds` what this process's calls carry from now on; returns the previous ones (to restore)."""
    global _client
    previous, _client = _client, creds
    return previous
