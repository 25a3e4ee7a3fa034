"""The user's first path, in CI: `make up` (default config, nothing given) -> `make train` (3 iterations) ->
`make scale-reward N=2` and `make scale-rollout N=2`, then back to 1 each -> a trainer's leader SIGKILLed ->
`make down`, with no process or port left.

`make up` returns while its services keep running (they are detached from it); the default config's tiny model
and data are made by `make up` itself in runs/tiny_cpu. The long version (150 iterations, scaling 1 -> 3 -> 1
while the run goes on, sample accounting) is tests/cluster/test_system.py's soak test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from services.common.processes import group_members
from services.launcher.system import pid_alive, port_open


def make(repo_root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=repo_root, capture_output=True, text=True,
                          timeout=timeout)


def rows(ps_stdout: str) -> dict[str, list[str]]:
    """`make ps`'s table by instance (the make line echoing the command is skipped)."""
    lines = [line.split() for line in ps_stdout.splitlines() if line and not line.startswith(".venv/")]
    return {r[1]: r for r in lines[1:]}


def test_make_up_train_scale_down_from_nothing(repo_root: Path, tmp_path: Path) -> None:
    system = tmp_path / "system"
    where = f"SYSTEM_DIR={system}"
    up = make(repo_root, "up", where, timeout=600)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "system up (6 processes" in up.stdout, up.stdout
    state = json.loads((system / "state.json").read_text())
    everything = {s["instance"]: s for s in state["services"]}
    try:
        time.sleep(1)  # the services were killed the moment `make up` returned before this was fixed
        ps = make(repo_root, "ps", where, timeout=120)
        table = rows(ps.stdout)
        assert set(table) == {"redis", "reward-0", "rollout-0", "trainer-actor", "trainer-reference", "coordinator"}
        assert table["redis"][4] == "RUNNING", ps.stdout
        assert all(r[4] == "SERVING" for name, r in table.items() if name != "redis"), ps.stdout

        train = make(repo_root, "train", where, "ARGS=-o megatron_training.train_iters=3", timeout=600)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        done = [int(n) for n in re.findall(r"^iteration (\d+) \|", train.stdout, re.M)]
        assert done == [1, 2, 3], train.stdout
        assert "RUN_PHASE_DONE at iteration 3" in train.stdout, train.stdout
        # The same command again: the actor holds iteration 3 already, so the run ends at once, saying why.
        again = make(repo_root, "train", where, "ARGS=-o megatron_training.train_iters=3", timeout=300)
        assert again.returncode == 0 and not re.search(r"^iteration \d+ \|", again.stdout, re.M), again.stdout
        assert ("nothing to train: the actor trainer already holds iteration 3 and megatron_training.train_iters is 3"
                in again.stdout), again.stdout

        scaled = make(repo_root, "scale-reward", "N=2", where, timeout=300)
        assert scaled.returncode == 0 and "started reward-1" in scaled.stdout, scaled.stdout + scaled.stderr
        more = make(repo_root, "scale-rollout", "N=2", where, timeout=600)
        assert more.returncode == 0 and "started rollout-1" in more.stdout, more.stdout + more.stderr
        everything.update({s["instance"]: s for s in json.loads((system / "state.json").read_text())["services"]})
        table = rows(make(repo_root, "ps", where, timeout=120).stdout)
        assert table["reward-1"][4] == "SERVING", table
        assert table["rollout-1"][4:6] == ["SERVING", "0"], table  # the HF folder's weights until a run syncs it
        # the run's three updates after its first sync, and the second run's sync (a run always syncs first)
        assert table["rollout-0"][5] == "5", table

        # Scaling down drains the newest and stops them; nothing of theirs is left.
        fewer = make(repo_root, "scale-rollout", "N=1", where, timeout=300)
        assert fewer.returncode == 0 and "rollout-1 drained and stopped" in fewer.stdout, fewer.stdout + fewer.stderr
        fewer = make(repo_root, "scale-reward", "N=1", where, timeout=300)
        assert fewer.returncode == 0 and "reward-1 drained and stopped" in fewer.stdout, fewer.stdout + fewer.stderr
        assert not group_members({everything["rollout-1"]["pid"], everything["reward-1"]["pid"]})
        left = json.loads((system / "state.json").read_text())["services"]
        assert sorted(s["instance"] for s in left if s["service"] in ("reward", "rollout")) == ["reward-0", "rollout-0"]

        # A trainer's leader SIGKILLed: its ranks (same process group) follow it within seconds.
        leader = everything["trainer-actor"]["pid"]
        ranks = [p for p in group_members({leader}) if p != leader]
        assert ranks, "the trainer leader has no rank processes"
        os.kill(leader, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in ranks), f"ranks {ranks} outlived their SIGKILLed leader by 10 s"
        assert rows(make(repo_root, "ps", where, timeout=120).stdout)["trainer-actor"][4] == "EXITED"
    finally:
        down = make(repo_root, "down", where, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "system down" in down.stdout
    assert not (system / "state.json").exists() and not (system / "secrets").exists()
    pids = {s["pid"] for s in everything.values()}
    assert not group_members(pids), f"left after down: {group_members(pids)}"
    assert not [s["address"] for s in everything.values() if s["address"] and port_open(s["address"])]
