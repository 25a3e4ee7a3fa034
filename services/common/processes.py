"""Child service processes: start with logs to files, wait for readiness, fail fast with the log's tail.

The one way rlfabric starts a service as a child (`python -m services.cli ...`, or a user's command for a
custom verifier): `rlfabric up` and `rlfabric eval` (services/launcher/stack.py) for every service, and the
tests and benchmarks for trainer groups (`start_trainer_group`). Each child gets its own session, so `stop` ends its whole process group (a
trainer group's ranks included).

Two policies, one per launcher (docs/architecture.md, "Process lifetimes"):
- Attached (`rlfabric up`, `rlfabric eval`, tests): children die with their parent. Each one asks the kernel for
  SIGKILL when the process that started it dies (`PR_SET_PDEATHSIG`), and `Reaper` (a small watchdog process
  holding a pipe from the parent) kills every child's process group (grandchildren included: a trainer's ranks,
  vLLM's engine core, reward pool slots) and Redis once that pipe closes, which is how a SIGKILLed `rlfabric up`
  still leaves no process or port behind.
- Detached (`rlfabric system up`, i.e. `make up`, and `system scale`): children outlive the command that started
  them (own session, no parent-death signal, no reaper, stdin from /dev/null); they end by `system down` or by
  their own failure.
`ChildWatcher` polls the children on a thread, so a dead one is named while the run is in the middle of an
iteration, not after it, and a stopped one (SIGSTOP: alive, silent) as soon as it stops.

A child names why it exits, when it knows, with one `EXIT_REASON` line on stderr (a trainer group: which rank
died of what); `ServiceProcess.check` puts that line in the error's first line, ahead of the log's tail.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    """A child service exited or did not become ready; the message carries its log's tail."""


_PR_SET_PDEATHSIG = 1
# Resolved before any fork: the child only calls it (loading a library between fork and exec could deadlock).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(own_session: bool = True) -> Callable[[], None]:
    """A `preexec_fn` for a child that must not outlive the process (thread) starting it, even a SIGKILLed one.

    `own_session`: the child leads a new session and process group (so `stop` ends the whole group); False
    keeps it in its parent's group (a trainer's ranks, which `system down` ends with their leader's group).
    """
    parent = os.getpid()

    def preexec() -> None:
        if own_session:
            os.setsid()
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request above took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def detach() -> None:
    """A `preexec_fn` for a child that outlives the process starting it: its own session (and process group,
    so `stop` and `system down` end the whole group), and no parent-death signal."""
    os.setsid()


# The prefix of the line a child writes to stderr, before it exits, to say why (see the module doc).
EXIT_REASON = "exit reason: "


def describe_exit(returncode: int) -> str:
    """"exited with code 1", or "exited with code -9 (killed by SIGKILL)" for a process a signal ended."""
    if returncode < 0:
        try:
            return f"exited with code {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"exited with code {returncode}"


def exit_reason(log_path: Path) -> str | None:
    """The last `EXIT_REASON` line of a child's log, without the prefix; None when it wrote none."""
    for line in reversed(tail(log_path, 200).splitlines()):
        if line.startswith(EXIT_REASON):
            return line.removeprefix(EXIT_REASON).strip()
    return None


@dataclass(frozen=True)
class ProcEntry:
    """One row of the process table (Linux /proc)."""

    pid: int
    state: str  # R, S, D, T (stopped), t (traced), Z (zombie), ...
    pgid: int
    sid: int


def process_table() -> list[ProcEntry]:
    """Every process of this host (an empty list where there is no /proc)."""
    rows = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        rows.append(ProcEntry(int(proc.name), fields[0], int(fields[2]), int(fields[3])))
    return rows


def group_members(pgids: set[int]) -> list[int]:
    """Pids of live processes in the process groups or sessions `pgids` (every service leads both: a trainer's
    ranks, vLLM's engine core, a reward worker's verifier processes... whether or not their leader still runs)."""
    return [e.pid for e in process_table() if e.state != "Z" and (e.pgid in pgids or e.sid in pgids)]


def stopped_members(pgid: int, table: Sequence[ProcEntry] | None = None) -> list[int]:
    """Pids of the process group or session `pgid` that are stopped (SIGSTOP, SIGTSTP: alive and doing nothing);
    `table` is a `process_table()` already read (one scan for several groups)."""
    return [e.pid for e in (process_table() if table is None else table)
            if e.state in ("T", "t") and (e.pgid == pgid or e.sid == pgid)]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServiceProcess:
    """One child: `rlfabric ARGS...`, or any `command` (argv) when given; stdout and stderr go to `log_path`.

    `detached`: the child outlives this process (see the module docstring); else it dies with it.
    """

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None
    proc: subprocess.Popen | None = None
    detached: bool = False

    def start(self) -> ServiceProcess:
        from services.common.security import open_private_log

        log = open_private_log(self.log_path)  # 0600: a service's log is the run's user's only
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        argv = self.command or [sys.executable, "-m", "services.cli", *self.args]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, preexec_fn=detach if self.detached else die_with_parent())
        except OSError as e:
            raise ServiceStartError(f"{self.name}: cannot run {' '.join(argv)!r}: {e}") from e
        finally:
            log.close()
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(argv))
        if Reaper.active is not None and not self.detached:
            Reaper.active.add_group(self.proc.pid)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            reason = exit_reason(self.log_path)
            raise ServiceStartError(f"{self.name} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}"
                                    f"{': ' + reason if reason else ''}; last lines of {self.log_path}:\n"
                                    f"{tail(self.log_path)}")

    def stop(self, grace_s: float = 10.0) -> None:
        stop_all([self], grace_s)


def stop_all(processes: Sequence[ServiceProcess], grace_s: float = 10.0) -> None:
    """SIGTERM to every child's process group at once, SIGKILL to the groups still there after `grace_s`: the
    children wind down side by side (N children cost one grace period at most, not N)."""
    live = [p for p in processes if p.alive()]
    for p in live:
        assert p.proc is not None
        os.killpg(p.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        assert p.proc is not None
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait()
        if Reaper.active is not None:
            Reaper.active.remove_group(p.proc.pid)


def start_trainer_group(log_dir: Path, args: Sequence[str], *, name: str = "trainer", env: dict[str, str] | None = None,
                        timeout_s: float = 300.0) -> tuple[ServiceProcess, str]:
    """`rlfabric trainer serve ARGS` as a child; returns it and rank 0's "host:port" once it serves.

    Readiness is the port file rank 0 writes (`--port-file`); the group's log is `log_dir/NAME.log`.
    """
    port_file = Path(log_dir) / f"{name}.port"
    port_file.unlink(missing_ok=True)
    group = ServiceProcess(name, ["trainer", "serve", *args, "--port-file", str(port_file)],
                           Path(log_dir) / f"{name}.log", env=dict(env or {})).start()
    try:
        wait_until(port_file.exists, [group], timeout_s, f"{name} (port file {port_file})")
    except BaseException:
        group.stop()
        raise
    return group, f"127.0.0.1:{port_file.read_text()}"


def wait_until(ready: Callable[[], bool], processes: Sequence[ServiceProcess], timeout_s: float, what: str) -> None:
    """Polls `ready` until true; raises with the failing child's log if one exits, or on timeout."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for p in processes:
            p.check()
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name} ({p.log_path}):\n{tail(p.log_path, 10)}" for p in processes)
            raise ServiceStartError(f"{what} not ready after {timeout_s:.0f}s\n{logs}")
        time.sleep(0.25)


class ChildWatcher:
    """Polls `processes()` every `interval_s` on a daemon thread; the first fatal death's error goes to `on_death`.

    `on_death` runs once, on the watcher's thread (`rlfabric up` uses it to interrupt its main thread).
    `survive(process, error)`, when given, is asked first about each death: True means the death was dealt
    with (the process dropped from `processes()` or replaced) and the watch goes on. `tick`, when given,
    runs on every poll first (`rlfabric up` restarts its private Redis there and reports stopped children);
    a `ServiceStartError` from it is fatal.
    """

    def __init__(self, processes: Callable[[], Sequence[ServiceProcess]],
                 on_death: Callable[[ServiceStartError], None], interval_s: float = 0.5,
                 tick: Callable[[], None] | None = None,
                 survive: Callable[[ServiceProcess, ServiceStartError], bool] | None = None) -> None:
        self._processes, self._on_death, self._interval_s = processes, on_death, interval_s
        self._tick, self._survive = tick, survive
        self._stop = threading.Event()
        self.error: ServiceStartError | None = None
        self._thread = threading.Thread(target=self._run, name="child-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._tick is not None:
                try:
                    self._tick()
                except ServiceStartError as e:
                    self.error = e
                    self._on_death(e)
                    return
            for p in list(self._processes()):
                try:
                    p.check()
                except ServiceStartError as e:
                    if self._survive is not None and self._survive(p, e):
                        continue
                    self.error = e
                    self._on_death(e)
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class Reaper:
    """A watchdog process that kills the registered process groups and pids once this process dies.

    It reads lines `+G PGID`, `-G PGID`, `+P PID` from a pipe whose only writer is this process; EOF (the
    kernel closes the pipe of a dead process, SIGKILL included) means: SIGTERM every group and pid, then
    SIGKILL what is left after `grace_s`. `close()` ends it without killing anything.

    `Reaper.install()` makes one the process's active reaper: every `ServiceProcess` started from then on
    is guarded by it, and it is closed at a normal exit (atexit), when the children were stopped already.
    """

    active: Reaper | None = None

    @classmethod
    def install(cls, grace_s: float = 5.0) -> Reaper:
        if cls.active is None:
            cls.active = cls(grace_s)
            atexit.register(cls.active.close)
        return cls.active

    def __init__(self, grace_s: float = 5.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "services.common.processes", "--reap", str(grace_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                                     text=True)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            logger.warning("reaper gone; %s not guarded", line)

    def add_group(self, pgid: int) -> None:
        self._send(f"+G {pgid}")

    def remove_group(self, pgid: int) -> None:
        self._send(f"-G {pgid}")

    def add_pid(self, pid: int) -> None:
        self._send(f"+P {pid}")

    def close(self) -> None:
        """Ends the reaper without killing anything (the children were stopped the normal way)."""
        if Reaper.active is self:
            Reaper.active = None
        if self.proc.poll() is not None:
            return
        self._send("QUIT")
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _kill_all(groups: set[int], pids: set[int], sig: int) -> bool:
    """Sends `sig`; True if anything was still there."""
    alive = False
    for send, ident in [(os.killpg, g) for g in groups] + [(os.kill, p) for p in pids]:
        try:
            send(ident, sig)
            alive = True
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def _reap_main(grace_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the terminal is the parent's to handle
    groups: set[int] = set()
    pids: set[int] = set()
    for line in sys.stdin:
        kind, _, ident = line.strip().partition(" ")
        if kind == "QUIT":
            return
        target = groups if kind[1:] == "G" else pids
        (target.add if kind[0] == "+" else target.discard)(int(ident))
    if not _kill_all(groups, pids, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _kill_all(groups, pids, 0):
        time.sleep(0.1)
    _kill_all(groups, pids, signal.SIGKILL)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap_main(float(sys.argv[2]))
