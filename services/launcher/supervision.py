"""What `rlfabric up` does while its run goes: a child dies, stops, or its private Redis dies.

The policy, one rule per kind of child:
- A reward worker or rollout replica is *redundant* while another of its kind is alive: its death costs
  the run nothing (the coordinator's reward pool re-sends the lost worker's samples, its replica set re-sends
  the lost replica's groups, each sample answered once). `up` prints which one died and which took over its
  work, restarts it (at most `MAX_RESTARTS` times per child: a child that keeps dying is left dead), and the run
  goes on; a restarted replica gets the current weights from the coordinator before it is given work.
- A tool server or code sandbox (multi-turn runs, services/launcher/tools.py) is *expendable*: its death never
  ends the run, even as the last of its kind. It is restarted like a redundant child (a sandbox on its own
  port, so the tool servers' URL stays right); until it is back, the calls it would have answered come back to
  the coordinator as tool errors (or go to another tool server), which the model reads like any tool error.
- Any other death is *fatal*: the last worker or replica of its kind, a trainer group (one rank's death
  ends its group; the group names the rank), the coordinator, a custom verifier. The run fails at once,
  whatever iteration it is in, with the child's name, pid, exit code and log tail.
- A child that is stopped (SIGSTOP: alive, holding its connections, doing nothing) is reported as soon as
  the watcher sees it, and again when it runs again; what then happens is the coordinator's (a stopped
  worker's samples are re-sent once its keepalive lapses; a stopped sole replica fails the run).
- The private Redis is restarted on the same port with its append-only file; the run goes on (the services'
  Redis clients retry through the restart, their heartbeats re-register them, the journal is replayed).

`Supervisor` holds the rules; as a context manager it runs a `ChildWatcher` thread that applies them every
half second and interrupts the main thread (SIGUSR1, whose handler raises the fatal error) so that a
blocking gRPC read there ends at once. `check()` applies the same rules from the main thread (after each
iteration, and when the coordinator's stream breaks).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any
from urllib.parse import urlparse

from services.common.processes import (
    ChildWatcher,
    Reaper,
    ServiceProcess,
    ServiceStartError,
    describe_exit,
    process_table,
    stopped_members,
)
from services.common.service_kind import ServiceKind
from services.launcher.stack import LocalStack
from services.launcher.tools import SANDBOX_KIND

# Kinds of child that may die while another of the kind carries on (the part of the name before "-N").
REDUNDANT = (ServiceKind.REWARD, ServiceKind.ROLLOUT)
# Kinds of child whose death costs the samples using them a tool error, never the run (see the module doc).
EXPENDABLE = (ServiceKind.TOOLS, SANDBOX_KIND)
# Restarts of one child per run: past this it is left dead (its kind carries on while one is alive).
MAX_RESTARTS = 3
# How long a broken coordinator stream waits for a dying child to be seen dead (the kernel closes a killed
# process's sockets a moment before the process can be reaped).
SETTLE_S = 2.0


def kind_of(process: ServiceProcess) -> str:
    return process.name.rsplit("-", 1)[0]


class Supervisor:
    """The policy of the module doc over `stack`'s children."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.restarts: dict[str, int] = {}
        self.stopped: dict[str, list[int]] = {}  # child name -> its stopped pids, as last reported
        self._lock = threading.Lock()
        self._previous_handler: Any = None
        self._watcher: ChildWatcher | None = None

    # -- the rules --------------------------------------------------------------------------------------

    def survive(self, process: ServiceProcess, error: ServiceStartError) -> bool:
        """Whether the run goes on after `process` died with `error` (restarting it when that is the policy)."""
        with self._lock:
            if process not in self.stack.processes:
                return True  # dealt with already (the watcher and the main thread both look)
            kind = kind_of(process)
            others = [p.name for p in self.stack.processes
                      if p is not process and kind_of(p) == kind and p.alive()]
            if kind in EXPENDABLE:
                goes_on = f"the run goes on{' with ' + ', '.join(others) if others else ''} (calls it would answer " \
                          "are tool errors until it is back)"
            elif kind in REDUNDANT and others:
                goes_on = f"the run goes on with {', '.join(others)}"
            else:
                return False
            assert process.proc is not None
            died = f"{process.name} (pid {process.proc.pid}) {describe_exit(process.proc.returncode)}"
            index = self.stack.processes.index(process)
            count = self.restarts.get(process.name, 0)
            if count >= MAX_RESTARTS:
                self.stack.processes.pop(index)
                self._say(f"{died}; {goes_on}; not restarted: it died {count + 1} times")
                return True
            self.restarts[process.name] = count + 1
            replacement = ServiceProcess(process.name, process.args, process.log_path, env=process.env,
                                         command=process.command, detached=process.detached)
            try:
                replacement.start()
            except ServiceStartError as e:
                self.stack.processes.pop(index)
                self._say(f"{died}; {goes_on}; restarting it failed: {e}")
                return True
            self.stack.processes[index] = replacement
            self._say(f"{died}; {goes_on}; restarted it as pid {replacement.pid} (log {process.log_path})")
            return True

    def check(self) -> None:
        """Applies the rules to every child now; raises the first fatal death's error."""
        for process in list(self.stack.processes):
            try:
                process.check()
            except ServiceStartError as e:
                if not self.survive(process, e):
                    raise

    def settle(self) -> None:
        """`check()` until `SETTLE_S` passes: for a broken stream whose cause may be a child dying right now."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.check()
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def tick(self) -> None:
        """Every poll: restart a dead private Redis, report children that stopped or run again."""
        self._keep_redis()
        table = process_table()  # one scan of /proc for every child
        for process in list(self.stack.processes):
            pids = stopped_members(process.pid, table) if process.alive() and process.pid else []
            before = self.stopped.get(process.name, [])
            if pids and pids != before:
                moves = "; its work moves to another once the coordinator's keepalive gives up on it (~20 s)" \
                    if kind_of(process) in REDUNDANT else ""
                self._say(f"{process.name} (pid {process.pid}) is stopped (pids {', '.join(map(str, pids))} in "
                          f"state T): it does nothing until it gets SIGCONT{moves}")
            elif before and not pids:
                self._say(f"{process.name} (pid {process.pid}) runs again")
            self.stopped[process.name] = pids

    def _keep_redis(self) -> None:
        """Restarts the stack's private Redis if it died (same port, same append-only file)."""
        redis = self.stack.redis
        if redis is None or redis.process.poll() is None:
            return
        port = urlparse(redis.url).port  # (the URL itself carries the password)
        self._say(f"redis (pid {redis.process.pid}) {describe_exit(redis.process.returncode)}; restarting it on "
                  f"port {port} with its append-only file")
        try:
            redis.restart()
        except RuntimeError as e:
            raise ServiceStartError(f"redis: {e}") from e
        if Reaper.active is not None:
            Reaper.active.add_pid(redis.process.pid)

    def _say(self, text: str) -> None:
        print(text, file=self.stack.out, flush=True)

    # -- the watcher thread -----------------------------------------------------------------------------

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals go to the main thread only; `check()` after each iteration still runs

        def raise_death(_signum: int, _frame: Any) -> None:
            if self._watcher is not None and self._watcher.error is not None:
                raise self._watcher.error

        main = threading.main_thread().ident
        assert main is not None
        self._previous_handler = signal.signal(signal.SIGUSR1, raise_death)
        self._watcher = ChildWatcher(lambda: self.stack.processes,
                                     lambda _e: signal.pthread_kill(main, signal.SIGUSR1), tick=self.tick,
                                     survive=self.survive)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            signal.signal(signal.SIGUSR1, self._previous_handler)
