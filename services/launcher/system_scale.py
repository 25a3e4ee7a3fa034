"""`rlfabric system scale` and `down` (the state they work on: services/launcher/system.py).

Scaling up starts more reward workers or rollout replicas exactly as `up` does and waits until each has
registered and reports SERVING: the coordinator's reward pool routes to a worker as soon as it registers, and
a rollout replica joins a run at its next weight version. Scaling down sends SIGTERM to the newest ones and
waits: a reward worker deregisters, answers what it holds and exits (nothing lost, nothing scored twice).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from services.common.processes import ServiceStartError, group_members, wait_until
from services.common.service_kind import ServiceKind
from services.launcher.system import (
    SECRETS,
    Entry,
    SystemStack,
    as_dicts,
    entries,
    pid_alive,
    port_open,
    read_state,
    secret,
    state_path,
    stop_pid,
    wait_serving,
    write_state,
)


def _index(entry: Entry) -> int:
    found = re.search(r"-(\d+)$", entry.instance)
    return int(found.group(1)) if found else -1


def scale(root: Path, service: ServiceKind, count: int, *, drain_s: float) -> int:
    state = read_state(root)
    items = [e for e in entries(state) if pid_alive(e.pid)]
    current = sorted((e for e in items if e.service == service), key=_index)
    if count > len(current):
        try:
            added = _add(root, state, service, count - len(current), start_index=_index(current[-1]) + 1
                         if current else 0)
        except ServiceStartError as e:
            print(f"error: {e}\n(the {service} processes just started were stopped again)", flush=True)
            return 1
        items += added
        print(f"{service}: started {', '.join(e.instance for e in added)} (now {count})", flush=True)
    for e in reversed(current[count:]):
        started = time.monotonic()
        stop_pid(e.pid, drain_s)
        items.remove(e)
        print(f"{service}: {e.instance} drained and stopped in {time.monotonic() - started:.1f}s", flush=True)
    write_state(root, {**state, "services": as_dicts(items)})
    return 0


def _add(root: Path, state: dict, service: ServiceKind, n: int, *, start_index: int) -> list[Entry]:
    """Starts `n` more, named from `start_index`; on any failure stops them all and raises."""
    from services.common.redis_store import Registry, connect

    url = secret(state, "redis_url_file")
    stack = SystemStack(root, redis_url=url, auth_token=secret(state, "token_file"))
    names = [f"{service}-{i}" for i in range(start_index, start_index + n)]
    for name in names:
        if service == ServiceKind.REWARD:
            stack.spawn_reward(name, int(state.get("reward_processes", 1)))
        else:
            stack.spawn_rollout(name, state["config"], list(state.get("overrides", [])))
    registry = Registry(connect(url))
    try:
        wait_until(lambda: set(names) <= {m.instance_id for m in registry.members(service)}, stack.processes,
                   600, f"{', '.join(names)} registered")
        added = [e for e in stack.entries() if e.instance in names]
        wait_serving(added, timeout_s=60)
    except BaseException:
        stack.stop()
        raise
    return added


def down(root: Path, *, grace_s: float) -> int:
    """Stops every process (coordinator first, Redis last); checks that none of their process groups and
    none of their ports remain; removes the state file."""
    state = read_state(root)
    items = entries(state)
    for e in reversed(items):
        if group_members({e.pid}):  # its leader, or what it left: a dead trainer's ranks, a dead vLLM's engine core
            what = "" if pid_alive(e.pid) else ", what its exited leader left"
            stop_pid(e.pid, grace_s)
            print(f"  stopped {e.instance} (pid {e.pid}{what})", flush=True)
    pgids = {e.pid for e in items}
    left = group_members(pgids)
    ports = [e.address for e in items if e.address and port_open(e.address)]
    ports += [f"127.0.0.1:{e.metrics_port}" for e in items if e.metrics_port and port_open(f"127.0.0.1:{e.metrics_port}")]
    if left or ports:
        print(f"error: still there after down: processes {left}, listening {ports}", flush=True)
        return 1
    state_path(root).unlink()
    shutil.rmtree(root / SECRETS, ignore_errors=True)  # the token and the URL with the gone Redis's password
    print(f"system down: {len(items)} processes stopped; none of their process groups ({len(pgids)}) has a process "
          f"left, none of their {sum(1 for e in items if e.address)} service ports listens", flush=True)
    return 0
