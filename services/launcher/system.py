"""`rlfabric system up|ps|logs|scale|down`: the GRPO services of one host as a detached system.

`up` starts Redis and every service (each in its own session, so it outlives `up`), waits until each has
registered and reports SERVING on gRPC health, writes DIR/state.json (service, instance, pid, address, log),
and returns; runs then go to its coordinator (`rlfabric train CONFIG`, which reads the address from there).
A service that fails to start fails `up` with its log's last lines, and everything started is stopped again.
`scale` starts or drains reward workers and rollout replicas; `down` stops everything and checks that no
process and no port of the system remain. A multi-turn config adds its tool servers and code sandbox
(services/launcher/tools.py; the sandbox answers HTTP `/health`, not gRPC health). Processes are started as `rlfabric up` starts them
(services/launcher/stack.py, services/common/processes.py).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from services.common.credentials import ClientCredentials, set_client_credentials
from services.common.processes import ServiceStartError, group_members
from services.common.service_kind import ServiceKind
from services.launcher.stack import Expected, LocalStack

STATE = "state.json"
LOCK = "state.lock"
SECRETS = "secrets"  # LocalStack's token and Redis URL files (0600 in a 0700 folder); `down` removes them


@dataclass
class Entry:
    """One process of the system, as `ps` shows it."""

    service: str  # redis, reward, rollout, trainer, coordinator, tools, sandbox
    instance: str  # its registry instance id (and log name)
    pid: int
    address: str
    log: str
    metrics_port: int = 0


class SystemStateError(RuntimeError):
    """No system where one was named, or its state file or lock says it cannot be used now."""


def state_path(root: Path) -> Path:
    return Path(root) / STATE


def read_state(root: Path) -> dict:
    path = state_path(root)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise SystemStateError(f"no system in {root} (no {path}): start one with `make up`") from e
    except json.JSONDecodeError as e:
        raise SystemStateError(f"{path}: not a state file ({e})") from e


def entries(state: dict) -> list[Entry]:
    return [Entry(**e) for e in state["services"]]


def write_state(root: Path, state: dict) -> None:
    tmp = state_path(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, state_path(root))


def secret(state: dict, key: str) -> str:
    """The token or Redis URL of a running system, read from the file the state names."""
    from services.common.security import read_secret_file

    try:
        return str(read_secret_file(state[key], key))
    except (KeyError, ValueError) as e:
        raise SystemStateError(f"the system's {key} cannot be read: {e}") from e


def system_client_args(args) -> None:
    """`rlfabric train` without --coordinator: the address, and the token file unless given, from the state."""
    state = read_state(args.system_dir)
    args.coordinator = next(e.address for e in entries(state) if e.service == ServiceKind.COORDINATOR)
    if not getattr(args, "auth_token_file", None):
        args.auth_token_file = state["token_file"]


def system_run_config(args) -> None:
    """`rlfabric train` without CONFIG: the config the system was started with, its overrides before the given."""
    state = read_state(args.system_dir)
    args.config = Path(state["config"])
    args.override = [*state.get("overrides", []), *args.override]


def configure_client_from(state: dict) -> None:
    """This process's calls (health, Info) carry the system's token."""
    set_client_credentials(ClientCredentials(secret(state, "token_file"), None))


@contextmanager
def locked(root: Path, wait_s: float = 0.0) -> Iterator[None]:
    """One `up`/`scale`/`down` at a time on a system directory; waits up to `wait_s` for the one that runs."""
    Path(root).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with (Path(root) / LOCK).open("w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as e:
                if time.monotonic() > deadline:
                    raise SystemStateError(f"another `rlfabric system` command holds {Path(root) / LOCK}") from e
                time.sleep(0.2)
        try:
            yield
        finally:
            # Nothing is left behind; a command that opened the file just before loses nothing by it either:
            # it fails to take the lock (non-blocking) or takes it on a file no one else will open.
            (Path(root) / LOCK).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
            return True
    except OSError:
        return False


def stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM to the process group and session `pid` leads, SIGKILL to what is left of them after `grace_s`;
    returns once no process of them remains (the leader may be gone already, its children not)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        targets = group_members({pid})
        if not targets:
            return
        for target in targets:  # each by pid: a member that made its own group is in the session still
            try:
                os.kill(target, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_members({pid}):
                return
            time.sleep(0.1)


class SystemStack(LocalStack):
    """A LocalStack whose children are named by registry instance id, so their addresses can be looked up.
    Security as `rlfabric up` has it: one token and the Redis URL (with the private Redis's password) reach
    the children as files in DIR/secrets. Its children are detached: they outlive `system up` and `system scale`
    and end by `system down` (or their own failure)."""

    detached = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.addresses: dict[str, str] = {}  # children that do not register in Redis (a sandbox): name -> address

    def spawn_reward(self, instance: str, processes: int) -> None:
        self.spawn(instance, ["reward", "serve", *self.redis_args(), "--worker-id", instance,
                              "--processes", str(processes)], Expected(instance, ServiceKind.REWARD))

    def spawn_rollout(self, instance: str, config: str, overrides: list[str]) -> None:
        self.spawn(instance, ["rollout", "serve", "--config", config, *[a for o in overrides for a in ("--set", o)],
                              "--address", "127.0.0.1:0", *self.redis_args(), "--instance-id", instance],
                   Expected(f"{instance} (vLLM)", ServiceKind.ROLLOUT))

    def entries(self) -> list[Entry]:
        """Every live child with the address it registered (Redis first)."""
        from services.common.redis_store import Registry, connect

        registry = Registry(connect(str(self.redis_url)))
        members = {(s, m.instance_id): m for s in ServiceKind for m in registry.members(s)}
        out = []
        if self.redis is not None:
            url = urlparse(str(self.redis_url))  # the address only: the URL carries the password
            out.append(Entry("redis", "redis", self.redis.process.pid, f"{url.hostname}:{url.port}",
                             str(self.redis.workdir / "redis.log")))
        for p in self.processes:
            service = p.name.split("-", 1)[0]
            m = members.get((service, p.name))
            out.append(Entry(service, p.name, p.proc.pid, m.endpoint if m else self.addresses.get(p.name, ""),
                             str(p.log_path),
                             int((m.metadata if m else {}).get("metrics_port") or 0)))
        return out


def wait_serving(items: list[Entry], timeout_s: float) -> None:
    """Every gRPC service reports SERVING on its health endpoint; ServiceStartError naming the one that does not."""
    deadline = time.monotonic() + timeout_s
    for e in items:
        if e.service == "redis":
            continue
        while (status := entry_health(e)) != "SERVING":
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{e.instance} at {e.address} reports {status} on gRPC health")
            time.sleep(0.5)


def entry_health(entry: Entry) -> str:
    """SERVING or why not: gRPC health for the services, HTTP `/health` for a sandbox, RUNNING for Redis."""
    from services.launcher.tools import SANDBOX_KIND, sandbox_health

    if entry.service == "redis":
        return "RUNNING"
    if entry.service == SANDBOX_KIND:
        return "SERVING" if entry.address and sandbox_health(f"http://{entry.address}") else "UNAVAILABLE"
    return health(entry.address)


def health(address: str, timeout_s: float = 3.0) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.client import make_channel

    if not address:
        return "UNREGISTERED"
    try:
        with make_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def weights_version(entry: Entry) -> str:
    """The weights version a rollout replica or trainer holds ("-" for the others or when it cannot say)."""
    import grpc

    from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
    from services.common.client import make_channel
    from services.common.deadlines import PS_PROBE_DEADLINE_S

    infos = {ServiceKind.ROLLOUT: (rollout_pb2_grpc.RolloutStub, rollout_pb2.RolloutInfoRequest),
             ServiceKind.TRAINER: (trainer_pb2_grpc.TrainerStub, trainer_pb2.TrainerInfoRequest)}
    if entry.service not in infos or not entry.address:
        return "-"
    stub, request = infos[entry.service]
    try:
        with make_channel(entry.address) as channel:
            return str(stub(channel).Info(request(), timeout=PS_PROBE_DEADLINE_S).weights_version)
    except grpc.RpcError:
        return "?"


def as_dicts(items: list[Entry]) -> list[dict]:
    return [asdict(e) for e in items]
