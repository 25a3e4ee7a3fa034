"""docs/running.md's resume recipe, run as written: the two `rlfabric up` commands of its bash block, with
MODEL, DATA and RUN set. The first is SIGKILLed once iteration 3 is logged (its checkpoint is iteration 2),
the resume runs to `train_iters=4`, so iteration 3 is computed again; metrics.jsonl then holds iterations
1..4 once each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # CI variant (with a Redis restart on the way): test_crash_resume_short.py


def recipe(repo_root: Path) -> list[str]:
    """The `rlfabric up` commands of the bash block under "## Resuming", continuation lines joined."""
    doc = (repo_root / "docs" / "running.md").read_text()
    section = doc[doc.index("## Resuming"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the Resuming section"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("rlfabric up")]


def wait_until_nothing_runs_in(run: Path, timeout_s: float = 30) -> None:
    """The crashed run's services are gone (its reaper ends them): their command lines name the run dir."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["pgrep", "-f", str(run)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "services of the killed run are still alive"
        time.sleep(0.5)


def test_the_resume_recipe_of_the_docs_works_as_written(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path,
                                                       tmp_path: Path) -> None:
    first, resume = recipe(repo_root)
    assert "--resume" in resume and "--resume" not in first
    run = tmp_path / "run"
    env = {**os.environ, "MODEL": str(tiny_model_dir), "DATA": str(arith_prefix), "RUN": str(run),
           "PATH": f"{repo_root / '.venv' / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(repo_root)}
    crashed = subprocess.Popen(["bash", "-c", f"exec {first}"], cwd=repo_root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        assert crashed.stdout is not None
        for line in crashed.stdout:
            seen.append(line)
            if line.startswith("iteration 3/"):
                crashed.send_signal(signal.SIGKILL)  # a crash: no stop, no last checkpoint
                break
        assert crashed.wait(timeout=60) == -signal.SIGKILL, "".join(seen[-50:])
    finally:
        if crashed.poll() is None:
            crashed.kill()
    wait_until_nothing_runs_in(run)
    metrics = run / "runs" / "tiny" / "metrics.jsonl"
    before = {r["iteration"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    assert sorted(before) == [1, 2, 3]
    done = subprocess.run(["bash", "-c", f"{resume} -o megatron_training.train_iters=4"], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{resume}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "iteration 4/4" in done.stdout and "iteration 2/4" not in done.stdout
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # iteration 3 ran twice, its row is there once
    assert rows[:2] == [before[1], before[2]]  # rows before the checkpoint kept as they were
    assert rows[2]["timing/all"] != before[3]["timing/all"]  # the recomputed iteration's row replaced the first
    assert [r["data/batch_index"] for r in rows] == [0, 1, 2, 3]  # the cursor went back to the checkpoint's
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
