"""Redis registry of remote verifiers: what `Reward.RegisterVerifier` writes and every worker reads.

Layout: hash `{prefix}:reward:verifiers` (name -> JSON entry) and a counter `{prefix}:reward:verifiers:rev`
bumped on every change, so that a worker polls one small key to learn that it must reload. Entries have
no lease: a registration lasts until `UnregisterVerifier`.
"""

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields

import redis

from services.common.status import echo
from services.reward.endpoints import split_endpoint

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CONCURRENCY = 16
MAX_TIMEOUT_S = 3600.0
MAX_CONCURRENCY = 1024
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

    A built-in name raises KeyError instead, so that the servicer can answer ALREADY_EXISTS. The
    endpoint's host is checked separately, against the worker's allow-list (`endpoints.py`).
    """
    if not _NAME.match(entry.name):
        raise ValueError(f"name {echo(entry.name)} must match [a-z0-9_.-]+")
    if entry.name in builtin_names:
        raise KeyError(f"name {echo(entry.name)} is a built-in verifier; choose another name")
    split_endpoint(entry.endpoint)
    if not math.isfinite(entry.timeout_s) or not 0 < entry.timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {entry.timeout_s}")
    if not 1 <= entry.max_concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"max_concurrency must be in 1..{MAX_CONCURRENCY}, got {entry.max_concurrency}")


def entry_from_json(name: str, value: str, builtin_names: set[str]) -> RemoteVerifierEntry:
    """The entry stored under `name`; ValueError saying what is wrong with a malformed one."""
    try:
        raw = json.loads(value)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {f.name for f in fields(RemoteVerifierEntry)})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    for key, value_type in (("name", str), ("version", str), ("endpoint", str), ("description", str),
                            ("max_concurrency", int), ("timeout_s", (int, float))):
        if key in raw and (not isinstance(raw[key], value_type) or isinstance(raw[key], bool)):
            raise ValueError(f"field {key!r} has the wrong type ({raw[key]!r})")
    if raw.get("name") != name:
        raise ValueError(f"its name {raw.get('name')!r} differs from its key {name!r}")
    try:
        entry = RemoteVerifierEntry(**raw)
    except TypeError as e:  # a required field missing
        raise ValueError(str(e)) from e
    try:
        validate_entry(entry, builtin_names)
    except KeyError as e:
        raise ValueError(str(e.args[0])) from e
    return entry


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

    def entries(self, builtin_names: set[str] = frozenset()) -> dict[str, RemoteVerifierEntry]:
        """The well-formed registrations by name; a malformed one is logged (with its key) and skipped.

        Anyone who can write Redis can write this hash, so nothing read here is trusted.
        """
        out = {}
        for name, value in self._client.hgetall(self._key).items():
            try:
                out[name] = entry_from_json(name, value, builtin_names)
            except ValueError as e:
                logger.warning("skipping the malformed verifier registration %s[%r]: %s", self._key, name, e)
        return out

    def revision(self) -> int:
        """A counter that changes whenever the registrations change."""
        value = self._client.get(self._rev_key)
        try:
            return int(value) if value is not None else 0
        except ValueError:
            logger.warning("%s holds %r, not a counter; reloading the registrations every time", self._rev_key, value)
            return -2  # never equal to a loaded revision: every sync reloads
