"""Closing the rollout's vLLM engine is bounded, and vLLM is shut down on the engine's own thread.

Found on the way to the rollout fuzzing's teardown hang (docs/reliability.md): `close()` waited up to 30 s for the
engine thread, then ran vLLM's shutdown on the caller's thread whatever the engine thread was still doing, and a
command queued as the close began was never run (its caller waited forever). Here the engine thread is held inside
a sample callback (callbacks run on it) of a sleeping engine while `close` is called. The engine runs in a process
of its own (engine_close_script.py): vLLM's shutdown tears down process-global state the session's engine needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A vLLM engine of its own in a subprocess (~40 s): in `make soak`; the suite's teardown exercises close() too.
pytestmark = pytest.mark.slow


def test_close_is_bounded_while_the_engine_thread_is_busy_and_shuts_vllm_down_on_that_thread(
        tiny_model_dir: Path, tmp_path: Path, repo_root: Path) -> None:
    pytest.importorskip("vllm")
    from services.rollout.samples import FINISH_ERROR

    done = subprocess.run([sys.executable, str(Path(__file__).parent / "engine_close_script.py"), str(tiny_model_dir),
                           str(tmp_path / "vllm_cache")], cwd=repo_root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["entered"] is True
    assert out["first_close"] is False  # busy thread: close returned at its bound, saying so
    assert out["call_after_close"] == "refused: the engine is closed"  # nothing is queued behind the close
    assert out["second_close"] is True  # the thread finished: it shut vLLM down and ended
    assert [(rid, reason) for rid, reason, _ in out["results"]] == [("held/0", FINISH_ERROR)]  # asleep: refused
    assert "asleep" in out["results"][0][2]
