"""Redis registry of remote verifiers: what `Reward.RegisterVerifier` writes and every worker reads.

Layout: hash `{prefix}:reward:verifiers` (name -> JSON entry) and a counter `{prefix}:reward:verifiers:rev`
bumped on every change, so that a worker polls one small key to learn that it must reload. Entries have
no lease: a registration lasts until `UnregisterVerifier`.
"""

import json
import re
from dataclasses import asdict, dataclass

import redis

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CONCURRENCY = 16
_NAME = re.compile(r"^[a-z0-9_.-]+$")


@dataclass(frozen=True)
class RemoteVerifierEntry:
    """A registered remote verifier (a server implementing `rlfabric.v1.Verifier`)."""

    name: str
    version: str
    endpoint: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    description: str = ""


def validate_entry(entry: RemoteVerifierEntry, builtin_names: set[str]) -> None:
    """Raises ValueError (naming the field) for an entry that cannot be registered.

    A built-in name raises KeyError instead, so that the servicer can answer ALREADY_EXISTS.
    """
    if not _NAME.match(entry.name):
        raise ValueError(f"name {entry.name!r} must match [a-z0-9_.-]+")
    if entry.name in builtin_names:
        raise KeyError(f"name {entry.name!r} is a built-in verifier; choose another name")
    host, sep, port = entry.endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {entry.endpoint!r} must be 'host:port'")
    if entry.timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {entry.timeout_s}")
    if entry.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {entry.max_concurrency}")


class VerifierStore:
    """Reads and writes remote verifier registrations in Redis."""

    def __init__(self, client: redis.Redis, prefix: str = "rlfabric") -> None:
        self._client = client
        self._key = f"{prefix}:reward:verifiers"
        self._rev_key = f"{self._key}:rev"

    def register(self, entry: RemoteVerifierEntry) -> RemoteVerifierEntry:
        """Stores (or replaces) `entry`; re-registering the same entry changes nothing."""
        value = json.dumps(asdict(entry), sort_keys=True)
        if self._client.hget(self._key, entry.name) == value:
            return entry
        pipe = self._client.pipeline()
        pipe.hset(self._key, entry.name, value)
        pipe.incr(self._rev_key)
        pipe.execute()
        return entry

    def unregister(self, name: str) -> bool:
        """Removes `name`; False when it was not registered."""
        pipe = self._client.pipeline()
        pipe.hdel(self._key, name)
        pipe.incr(self._rev_key)
        removed, _ = pipe.execute()
        return bool(removed)

    def entries(self) -> dict[str, RemoteVerifierEntry]:
        """All registrations by name."""
        raw = self._client.hgetall(self._key)
        return {name: RemoteVerifierEntry(**json.loads(value)) for name, value in raw.items()}

    def revision(self) -> int:
        """A counter that changes whenever the registrations change."""
        value = self._client.get(self._rev_key)
        return int(value) if value is not None else 0
