"""Services on one host: Redis (private unless given), child services, custom verifiers; stopped in reverse.

`LocalStack` knows how to start a child, wait until every child it expects has registered in Redis (printing
each one as it comes up, so a user sees progress during the tens of seconds a vLLM engine and Megatron take
to load), and register custom verifiers. What to start is its callers' choice: `rlfabric up` starts the GRPO
set (services/launcher/grpo.py), `rlfabric eval` a rollout replica and reward workers.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from services.common.credentials import ClientCredentials, set_client_credentials
from services.common.processes import ServiceProcess, ServiceStartError
from services.common.redis_store import RedisServer, Registry, connect, start_private_redis
from services.common.security import child_args, generate_tls, private_dir, write_secret_file
from services.common.service_kind import ServiceKind
from services.launcher import verifiers as custom

logger = logging.getLogger(__name__)

__all__ = ["LocalStack", "ServiceStartError"]

# With nothing new ready for this long, the progress display says what it still waits for.
QUIET_PROGRESS_S = 10.0
# How often start-up polls Redis for new registrations: the last service's readiness reaches the console (and the
# run's start) at most this late.
READY_POLL_S = 0.1


@dataclass(frozen=True)
class Expected:
    """A registration a started child will make: its Redis service name and, for trainers, the role."""

    label: str
    service: ServiceKind
    role: str | None = None


class LocalStack:
    """Children of one local run, with their logs in `run_dir/logs`.

    Security is on: one token for every service-to-service call (the given one, else a fresh one), a private
    Redis with a fresh password, and TLS when `tls` is given ("generate": a CA of this run's own). Children get
    them as files in `run_dir/secrets` (0600; the folder 0700) named by flags, never as values on a command line.

    Args:
        redis_url: use this Redis instead of starting a private one in `run_dir/redis`.
        verifiers: custom verifiers to start (command) and register once the reward workers are up.
        out: where progress lines go.
        auth_token: the service token (default: a fresh random one).
        tls: None (plaintext), "generate", or (cert, key, ca) PEM paths every service serves and trusts.
    """

    # Children die with the process that started them (services/common/processes.py); SystemStack's outlive it.
    detached = False

    def __init__(self, run_dir: Path, *, redis_url: str | None = None, startup_timeout_s: float = 600.0,
                 verifiers: Sequence[custom.CustomVerifier] = (), out: TextIO | None = None,
                 auth_token: str | None = None, tls: str | tuple[Path, Path, Path] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.redis_url = redis_url
        self.startup_timeout_s = startup_timeout_s
        self.verifiers = list(verifiers)
        self.out = out or sys.stdout
        self.auth_token = auth_token or secrets.token_hex(32)
        self.tls_request = tls
        self.tls: tuple[Path, Path, Path] | None = None
        self.token_file: Path | None = None
        self.redis_url_file: Path | None = None
        self._client_before: ClientCredentials | None = None
        self.redis: RedisServer | None = None
        self.processes: list[ServiceProcess] = []
        self.expected: list[Expected] = []
        self._verifier_procs: list[tuple[custom.CustomVerifier, ServiceProcess | None]] = []
        self._started = time.monotonic()

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def secrets_dir(self) -> Path:
        return self.run_dir / "secrets"

    def prepare_security(self) -> None:
        """Writes the token (and TLS material) to `secrets_dir`; this process's calls use them from now on."""
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.chmod(0o700)
        self.token_file = write_secret_file(self.secrets_dir / "token", self.auth_token)
        if self.tls_request == "generate":
            self.tls = generate_tls(self.secrets_dir)
        elif self.tls_request is not None:
            self.tls = tuple(Path(p).resolve() for p in self.tls_request)  # type: ignore[assignment]
        self._client_before = set_client_credentials(
            ClientCredentials(self.auth_token, str(self.tls[2]) if self.tls else None))

    def start_redis(self) -> str:
        """The Redis URL: the given one, else a private server's (append-only file in run_dir/redis, a password).

        The URL goes to children in a 0600 file (`redis_args`), as it may hold the password.
        """
        private_dir(self.run_dir)  # logs, Redis' files and secrets inside: the run's user's only
        self._started = time.monotonic()
        if self.redis_url is None:
            self.redis = start_private_redis(str(self.run_dir / "redis"), appendonly=True,
                                             password=secrets.token_hex(24))
            self.redis_url = self.redis.url
        return self.redis_url

    def redis_args(self) -> list[str]:
        """The flags that give a child the Redis URL (a file; the URL may carry the password)."""
        if self.redis_url_file is None:
            url = self.start_redis() if self.redis_url is None else self.redis_url
            self.secrets_dir.mkdir(parents=True, exist_ok=True)
            self.secrets_dir.chmod(0o700)
            self.redis_url_file = write_secret_file(self.secrets_dir / "redis-url", url)
        return ["--redis-url-file", str(self.redis_url_file)]

    def security_args(self, server: bool = True) -> list[str]:
        """The flags that give a child the token and TLS material (paths; see services/common/security.py)."""
        if self.token_file is None:
            self.prepare_security()
        return child_args(token_file=self.token_file, tls=self.tls, server=server)

    def spawn(self, name: str, args: list[str], expect: Expected | None = None,
              env: dict[str, str] | None = None) -> ServiceProcess:
        """Starts `rlfabric ARGS` as child `name` with the stack's security flags appended (`args` is a
        `serve` command); `expect` is the registration that says it is ready."""
        proc = ServiceProcess(name, [*args, *self.security_args()], self.logs_dir / f"{name}.log",
                              env=env or {}, detached=self.detached).start()
        self.processes.append(proc)
        if expect is not None:
            self.expected.append(expect)
        return proc

    def spawn_reward_workers(self, count: int, processes: int) -> None:
        for i in range(count):
            self.spawn(f"reward-{i}", ["reward", "serve", *self.redis_args(), "--processes", str(processes)],
                       Expected(f"reward-{i}", ServiceKind.REWARD))

    def spawn_verifiers(self) -> None:
        """Starts the command verifiers (their servers load while the services do)."""
        for v in self.verifiers:
            proc, located = custom.launch(v, self.logs_dir)
            if proc is not None:
                self.processes.append(proc)
            self._verifier_procs.append((located, proc))

    def wait_ready(self) -> None:
        """Waits, printing progress, until every expected child is registered; registers the verifiers as soon as
        the reward workers are (beside the slower services' start-up, not after it)."""
        registry = Registry(connect(str(self.redis_url)))
        pending = list(self.expected)
        last_news = time.monotonic()
        registered = False
        while pending:
            for p in self.processes:
                p.check()
            ready = self._newly_ready(registry, pending)
            for e in ready:
                pending.remove(e)
                self._say(f"  {e.label} ready")
                last_news = time.monotonic()
            if pending and time.monotonic() - last_news > QUIET_PROGRESS_S:
                self._say(f"  waiting for {', '.join(e.label for e in pending)}")
                last_news = time.monotonic()
            if pending and time.monotonic() - self._started > self.startup_timeout_s:
                raise ServiceStartError(f"{', '.join(e.label for e in pending)} not ready after "
                                        f"{self.startup_timeout_s:.0f}s; logs in {self.logs_dir}")
            if not registered and not any(e.service == ServiceKind.REWARD for e in pending):
                self.register_verifiers(self.auth_token)
                registered = True
                continue
            time.sleep(READY_POLL_S)
        if not registered:
            self.register_verifiers(self.auth_token)

    def register_verifiers(self, token: str | None) -> None:
        """Waits until the custom verifiers serve, then registers them with every reward worker in Redis."""
        if not self._verifier_procs:
            return
        for v, proc in self._verifier_procs:
            custom.wait_serving(v, proc, max(10.0, self.startup_timeout_s - (time.monotonic() - self._started)))
        custom.register([v for v, _ in self._verifier_procs], self.endpoints(ServiceKind.REWARD), token)
        for v, _ in self._verifier_procs:
            self._say(f"  verifier {v.name} registered ({v.endpoint})")

    def endpoints(self, service: ServiceKind, role: str | None = None) -> list[str]:
        registry = Registry(connect(str(self.redis_url)))
        return sorted(m.endpoint for m in registry.members(service)
                      if role is None or m.metadata.get("role") == role)

    def _newly_ready(self, registry: Registry, pending: list[Expected]) -> list[Expected]:
        """Pending entries whose registrations are there: with N workers of one kind, one per registration."""
        ready: list[Expected] = []
        for key in dict.fromkeys((e.service, e.role) for e in pending):
            waiting = [e for e in pending if (e.service, e.role) == key]
            announced = sum(1 for e in self.expected if (e.service, e.role) == key) - len(waiting)
            members = [m for m in registry.members(key[0]) if key[1] is None or m.metadata.get("role") == key[1]]
            ready += waiting[:max(0, len(members) - announced)]
        return ready

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self._started:5.1f}s]{text}", file=self.out, flush=True)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        if self.redis is not None:
            self.redis.stop()
        if self._client_before is not None:  # this process's calls go back to what they were before the stack
            set_client_credentials(self._client_before)
            self._client_before = None
