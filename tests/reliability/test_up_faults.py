"""Faults injected into a whole `rlfabric up` run on the tiny model (slow: each is a full run).

- Redis SIGKILLed mid-run: `up` restarts it on the same port with its append-only file; the run finishes
  with every iteration journaled once.
- A child SIGKILLed or SIGSTOPped mid-run (reward worker, rollout replica, trainer rank, coordinator; one of
  each, so there is no survivor to fail over to): `up` fails the run cleanly, naming the dead child
  (service, pid, exit code) where one died, and leaves nothing behind.
- `up` itself SIGKILLed: no descendant process and no Redis survive it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.console import ConsoleProcess

pytestmark = pytest.mark.slow  # CI variant of the Redis restart and `up` SIGKILL: test_crash_resume_short.py


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `root`, and of their process groups."""
    table: dict[int, tuple[int, int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fields[0] != "Z":
                table[int(entry.name)] = (int(fields[1]), int(fields[2]), cmd)
    found = {root}
    while True:
        more = {p for p, (ppid, pgid, _) in table.items() if p not in found and (ppid in found or pgid in found - {root})}
        if not more:
            break
        found |= more
    return {p: table[p][2] for p in found - {root} if p in table}


class Up(ConsoleProcess):
    """`rlfabric up` on the tiny config, its output collected on a thread."""

    def __init__(self, repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, run_dir: Path, *extra: str) -> None:
        self.run_dir = run_dir
        super().__init__("up", [
            sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={tiny_model_dir}",
            "-o", f"megatron_training.data_path={arith_prefix}", "-o", f"actor_config.load={tiny_model_dir}",
            "-o", f"actor_config.save={run_dir / 'ckpt'}", "-o", "megatron_training.save_interval=100",
            "--run-dir", str(run_dir), *extra], repo_root)

    def wait_for(self, pattern: str, timeout_s: float = 600) -> re.Match:
        return super().wait_for(pattern, timeout_s)

    def child(self, needle: str) -> int:
        return next(p for p, cmd in descendants(self.proc.pid).items() if needle in cmd)

    def finish(self, timeout_s: float = 900) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        time.sleep(0.5)  # the reader thread drains the pipe
        return rc

    def cleanup(self) -> None:
        left = descendants(self.proc.pid) if self.proc.poll() is None else {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if Path(f"/proc/{p}").exists() and
                    (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_redis_sigkilled_mid_run_is_restarted_and_the_run_continues(repo_root, tiny_model_dir, arith_prefix,
                                                                     tmp_path) -> None:
    up = Up(repo_root, tiny_model_dir, arith_prefix, tmp_path / "run", "-o", "megatron_training.train_iters=4",
            "--run-id", "redis-restart")
    try:
        up.wait_for(r"iteration 1/4")
        redis_pid = up.child("redis-server")
        os.kill(redis_pid, signal.SIGKILL)
        assert up.finish() == 0, up.output[-4000:]
        assert f"redis (pid {redis_pid}) exited with code -9 (killed by SIGKILL); restarting it" in up.output
        rows = [json.loads(x) for x in (tmp_path / "run" / "runs" / "redis-restart" / "metrics.jsonl").read_text()
                .splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
        assert "run redis-restart: RUN_PHASE_DONE at iteration 4" in up.output
    finally:
        up.cleanup()


# (victim: a command-line fragment of the process to hit, signal, what up's output must then say)
FAULTS = {
    "reward-SIGKILL": ("reward serve", signal.SIGKILL, "reward-0 (pid {pid}) exited with code -9 (killed by SIGKILL); last lines of"),
    "rollout-SIGKILL": ("rollout serve", signal.SIGKILL, "rollout-0 (pid {pid}) exited with code -9 (killed by SIGKILL); last lines of"),
    "coordinator-SIGKILL": ("coordinator serve", signal.SIGKILL,
                            "coordinator (pid {pid}) exited with code -9 (killed by SIGKILL); last lines of"),
    "trainer_rank-SIGKILL": ("trainer rank", signal.SIGKILL,
                             "(pid {pid}) exited with code -9 (killed by SIGKILL); the group stops its other ranks"),
    "rollout-SIGSTOP": ("rollout serve", signal.SIGSTOP, "RUN_PHASE_FAILED"),
    "coordinator-SIGSTOP": ("coordinator serve", signal.SIGSTOP, "error: coordinator: UNAVAILABLE"),
    "trainer_rank-SIGSTOP": ("trainer rank", signal.SIGSTOP, "RUN_PHASE_FAILED"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_child_killed_or_stopped_mid_run_fails_the_run_cleanly(fault, repo_root, tiny_model_dir, arith_prefix,
                                                                  tmp_path) -> None:
    needle, sig, expected = FAULTS[fault]
    # rpc_deadline_s bounds what a stopped trainer rank costs (its server still answers keepalive pings).
    up = Up(repo_root, tiny_model_dir, arith_prefix, tmp_path / "run", "-o", "megatron_training.train_iters=50",
            "-o", "rlfabric.rpc_deadline_s=60")
    victim = None
    try:
        up.wait_for(r"iteration 1/50")
        victim = up.child(needle)
        everything = descendants(up.proc.pid)
        os.kill(victim, sig)
        hit_at = time.monotonic()
        assert up.finish(timeout_s=300) == 1, up.output[-3000:]
        print(f"\n{fault}: up failed {time.monotonic() - hit_at:.1f} s after the signal")
        assert expected.format(pid=victim) in up.output, up.output[-3000:]
        assert wait_gone(everything, 60) == [], {p: everything[p] for p in wait_gone(everything, 0)}
    finally:
        if victim is not None and sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        up.cleanup()


def test_sigkill_of_up_leaves_no_process_and_no_redis(repo_root, tiny_model_dir, arith_prefix, tmp_path) -> None:
    up = Up(repo_root, tiny_model_dir, arith_prefix, tmp_path / "run", "-o", "megatron_training.train_iters=50")
    try:
        up.wait_for(r"iteration 1/50")
        everything = descendants(up.proc.pid)
        assert any("redis-server" in c for c in everything.values())
        assert len(everything) >= 6, everything  # Redis, reward, rollout, 2 trainers, coordinator (+ ranks, reaper)
        up.proc.kill()
        up.proc.wait()
        assert wait_gone(everything, 30) == [], {p: everything[p] for p in wait_gone(everything, 0)}
    finally:
        up.cleanup()
