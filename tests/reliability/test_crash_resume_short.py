"""The CI variant of the soak's crash tests (test_resume_doc.py, and test_up_faults.py's Redis restart and
SIGKILL of `up`), on one run: the two commands of docs/running.md's resume recipe as written (plus shorter
responses and a `train_iters` override). The first run's private Redis is SIGKILLed after iteration 1 (`up`
restarts it and the run goes on); then `up` itself is SIGKILLed at the first odd iteration after that (a crash
one iteration past a checkpoint: no stop, no last checkpoint) and must leave no process. The resume command must
find the journal the restarted Redis kept, compute the crashed iteration again and log every iteration once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.console import ConsoleProcess
from tests.reliability.test_resume_doc import recipe
from tests.reliability.test_up_faults import descendants, wait_gone

# Shorter responses (both commands): the iterations, not the recipe, are what this test can make cheaper.
SHORTER = "-o generate_config.sampling_config.max_tokens=16"


def test_a_crash_after_a_redis_restart_resumes_by_the_docs_recipe(repo_root: Path, tiny_model_dir: Path,
                                                                 arith_prefix: Path, tmp_path: Path) -> None:
    first, resume = recipe(repo_root)
    run = tmp_path / "run"
    values = {"MODEL": str(tiny_model_dir), "DATA": str(arith_prefix), "RUN": str(run),
              "PATH": f"{repo_root / '.venv' / 'bin'}:{os.environ['PATH']}"}
    # `exec`: the pid is `up`'s, so the SIGKILL below is a crash of `up` itself.
    up = ConsoleProcess("up", ["env", *(f"{k}={v}" for k, v in values.items()), "bash", "-c",
                               f"exec {first} {SHORTER} -o megatron_training.train_iters=50"], repo_root)
    everything: dict[int, str] = {}
    try:
        up.wait_for(r"(?m)^iteration 1/50", 600)
        (redis_pid,) = [p for p, cmd in descendants(up.proc.pid).items() if "redis-server" in cmd]
        os.kill(redis_pid, signal.SIGKILL)
        restarted = up.wait_for(rf"redis \(pid {redis_pid}\) exited with code -9 \(killed by SIGKILL\); restarting it", 120)
        # The first odd iteration finished after the restart: its checkpoint (save_interval 2) is one behind.
        odd = re.compile(r"^iteration (\d*[13579])/50", re.M)
        deadline = time.monotonic() + 300
        while not (found := odd.search(up.output, restarted.end())):
            assert up.proc.poll() is None and time.monotonic() < deadline, up.output[-4000:]
            time.sleep(0.05)
        crash_at = int(found.group(1))
        everything = descendants(up.proc.pid)
        assert any("trainer rank" in cmd for cmd in everything.values()), everything
        up.proc.kill()
        assert up.proc.wait(timeout=60) == -signal.SIGKILL
        # Nothing outlives the crash: services, trainer ranks, the restarted Redis.
        assert wait_gone(everything, 30) == [], {p: everything[p] for p in wait_gone(everything, 0)}
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
        for pid in wait_gone(everything, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    metrics = run / "runs" / "tiny" / "metrics.jsonl"
    before = {r["iteration"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    assert sorted(before) == list(range(1, crash_at + 1))
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(crash_at - 1)

    end = crash_at + 1
    env = {**os.environ, **values, "PYTHONPATH": str(repo_root)}
    done = subprocess.run(["bash", "-c", f"{resume} {SHORTER} -o megatron_training.train_iters={end}"], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{resume}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # It starts after the checkpoint: the console shows the crashed iteration, computed again, and the next one.
    assert f"iteration {crash_at}/{end}" in done.stdout and f"iteration {end}/{end}" in done.stdout, done.stdout
    assert f"iteration {crash_at - 1}/" not in done.stdout, done.stdout
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, end + 1))  # the recomputed iteration's row is there once
    assert rows[:crash_at - 1] == [before[i] for i in range(1, crash_at)]  # rows before the checkpoint kept
    assert rows[crash_at - 1]["timing/all"] != before[crash_at]["timing/all"]  # the crashed one's row replaced
    assert [r["data/batch_index"] for r in rows] == list(range(end))  # the cursor went back to the checkpoint's
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(end)
