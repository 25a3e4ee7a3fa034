"""Child service processes: start with logs to files, wait for readiness, fail fast with the log's tail.

The one way rlfabric starts a service as a child (`python -m services.cli ...`, or a user's command for a
custom verifier): `rlfabric up` and `rlfabric eval` (services/launcher/stack.py) for every service, and the
tests and benchmarks for trainer groups (`start_trainer_group`). Each child gets its own session, so `stop` ends its whole process group (a
trainer group's ranks included).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    """A child service exited or did not become ready; the message carries its log's tail."""


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ServiceProcess:
    """One child: `rlfabric ARGS...`, or any `command` (argv) when given; stdout and stderr go to `log_path`."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        argv = self.command or [sys.executable, "-m", "services.cli", *self.args]
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            raise ServiceStartError(f"{self.name}: cannot run {' '.join(argv)!r}: {e}") from e
        finally:
            log.close()
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(argv))
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServiceStartError(f"{self.name} exited with code {self.proc.returncode}; last lines of "
                                    f"{self.log_path}:\n{tail(self.log_path)}")

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


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
