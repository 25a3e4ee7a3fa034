"""`rlfabric up`'s children: watched while the run goes (a dead one named at once; one of two reward workers
restarted while the other carries on; a stopped one reported at once), and never left behind, not even by a
SIGKILLed parent (tests/reliability/stack_script.py runs a LocalStack as `up` does)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from services.common.processes import group_members

SCRIPT = Path(__file__).with_name("stack_script.py")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_open(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((u.hostname, u.port)) == 0


class Script:
    def __init__(self, repo_root: Path, run_dir: Path, mode: str, workers: int = 1) -> None:
        env = {**os.environ, "PYTHONPATH": str(repo_root)}
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), mode, str(workers)], cwd=repo_root,
                                     env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None
        self._cursor = 0
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                self.info = json.loads(line)
                return
        pytest.fail("the stack did not come up:\n" + "".join(self.lines))

    def _read_rest(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, needle: str, timeout_s: float = 30) -> tuple[str, float]:
        """The first line after the previous one found that contains `needle`, and how long this call waited."""
        if self._reader is None:
            self._cursor = len(self.lines)
            self._reader = threading.Thread(target=self._read_rest, daemon=True)
            self._reader.start()
        start = time.monotonic()
        while time.monotonic() < start + timeout_s:
            for i in range(self._cursor, len(self.lines)):
                if needle in self.lines[i]:
                    self._cursor = i + 1
                    return self.lines[i], time.monotonic() - start
            time.sleep(0.05)
        pytest.fail(f"no line with {needle!r}:\n" + "".join(self.lines))

    def rest(self, timeout_s: float = 60) -> str:
        if self._reader is None:
            out, _ = self.proc.communicate(timeout=timeout_s)
            return "".join(self.lines) + out
        self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return "".join(self.lines)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_sigkill_of_the_launcher_leaves_no_child_and_no_redis(repo_root: Path, tmp_path: Path) -> None:
    script = Script(repo_root, tmp_path / "run", "sleep")
    try:
        worker = script.info["children"]["reward-0"]
        guarded = group_members({worker}) + [script.info["redis_pid"]]
        assert len(guarded) >= 4, guarded  # the worker, its two pool processes, Redis
        os.kill(script.proc.pid, signal.SIGKILL)
        script.proc.wait()
        assert wait_gone(guarded, 15) == []
        assert not port_open(script.info["redis_url"])
    finally:
        script.cleanup()
        for pid in group_members({script.info["children"]["reward-0"]}) + [script.info["redis_pid"]]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_killed_mid_run_is_named_at_once_and_everything_stops(repo_root: Path, tmp_path: Path) -> None:
    script = Script(repo_root, tmp_path / "run", "watch")
    try:
        worker = script.info["children"]["reward-0"]
        members = group_members({worker})
        os.kill(worker, signal.SIGKILL)
        out = script.rest(timeout_s=60)
        assert script.proc.returncode == 3, out
        assert f"reward-0 (pid {worker}) exited with code -9 (killed by SIGKILL)" in out
        assert "last lines of" in out and "reward-0.log" in out
        assert wait_gone(members + [script.info["redis_pid"]], 15) == []
    finally:
        script.cleanup()


def test_a_killed_private_redis_is_restarted_on_its_port_with_its_journal(repo_root: Path, tmp_path: Path) -> None:
    from services.common.redis_store import Registry, RunJournal, connect

    script = Script(repo_root, tmp_path / "run", "watch")
    try:
        url, old_pid = script.info["redis_url"], script.info["redis_pid"]
        client = connect(url)
        RunJournal(client, "survivor").record_iteration(1, {"reward": 0.5}, weights_version=2)
        time.sleep(1.5)  # appendfsync everysec: the entry is on disk
        os.kill(old_pid, signal.SIGKILL)
        registry = Registry(client)  # its retries ride out the restart
        assert RunJournal(client, "survivor").iterations() == {1: {"reward": 0.5}}
        deadline = time.monotonic() + 30  # the worker's heartbeat (lease / 3) registers it again
        while not registry.members("reward"):
            assert time.monotonic() < deadline, "the reward worker did not re-register"
            time.sleep(0.2)
        assert script.proc.poll() is None  # the stack goes on
        new_pid = int(client.info("server")["process_id"])
        assert new_pid != old_pid
        os.kill(script.proc.pid, signal.SIGTERM)
        out = script.rest()
        port = urlparse(url).port
        assert f"redis (pid {old_pid}) exited with code -9 (killed by SIGKILL); restarting it on port {port} with" in out
        password = urlparse(url).password
        said = next(line for line in out.splitlines() if "restarting it" in line)
        assert password and password not in said  # the private Redis has one, and it stays out of the message
        assert wait_gone([new_pid], 15) == []
    finally:
        script.cleanup()


def test_one_of_two_workers_dies_the_stack_goes_on_and_restarts_it_a_stopped_one_is_reported(
        repo_root: Path, tmp_path: Path) -> None:
    from services.common.redis_store import Registry, connect

    script = Script(repo_root, tmp_path / "run", "watch", workers=2)
    try:
        first, second = script.info["children"]["reward-0"], script.info["children"]["reward-1"]
        registry = Registry(connect(script.info["redis_url"]))
        os.kill(first, signal.SIGSTOP)
        line, _ = script.wait_line(f"reward-0 (pid {first}) is stopped", timeout_s=15)  # polled twice a second
        assert "it does nothing until it gets SIGCONT" in line and "its work moves to another" in line, line
        os.kill(first, signal.SIGCONT)
        script.wait_line(f"reward-0 (pid {first}) runs again")
        before = {m.instance_id for m in registry.members("reward")}
        os.kill(second, signal.SIGKILL)
        line, _ = script.wait_line(f"reward-1 (pid {second}) exited with code -9 (killed by SIGKILL)")
        assert "the run goes on with reward-0; restarted it as pid" in line, line
        restarted = int(line.split("restarted it as pid ")[1].split()[0])
        assert alive(restarted) and restarted != second
        deadline = time.monotonic() + 60  # the new worker registers under a new instance id
        while not ({m.instance_id for m in registry.members("reward")} - before):
            assert time.monotonic() < deadline, "the restarted worker did not register"
            time.sleep(0.2)
        assert script.proc.poll() is None  # the stack goes on
        os.kill(script.proc.pid, signal.SIGTERM)
        script.rest()
        assert wait_gone([first, restarted], 15) == []
    finally:
        script.cleanup()
