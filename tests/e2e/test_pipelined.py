"""Pipelined (one-step off-policy) mode through the real CLI: `rlfabric up` with `rlfabric.max_staleness: 1`.

Three iterations of configs/grpo_tiny_cpu.yaml (disaggregated, KL on): the rollout of iteration k+1 runs while
the actor updates on k, with the weights of k-1. The run must finish, train every batch once in order, fence
every sample to at most one version behind the actor (the coordinator and the trainer's Update both refuse
more), weight the off-policy tokens by the truncated importance ratio, and log the staleness.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.test_grpo_run import read_metrics, run_up

ITERATIONS = 3
CAP = 2.0


@pytest.fixture(scope="module")
def pipelined_run(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("pipelined")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir,
                  "-o", f"megatron_training.train_iters={ITERATIONS}", "-o", "megatron_training.save_interval=1000",
                  "-o", "rlfabric.max_staleness=1", "-o", f"rlfabric.importance_sampling_cap={CAP}")
    return proc, run_dir


def test_pipelined_run_trains_every_batch_once_with_bounded_staleness(pipelined_run: tuple) -> None:
    proc, run_dir = pipelined_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
    # The first iteration has nothing to overlap with (on-policy); every later one trains on samples of the
    # weights one update older than the actor's.
    assert [m["staleness/max"] for m in metrics] == [0.0] + [1.0] * (ITERATIONS - 1)
    assert [m["staleness/mean"] for m in metrics] == [0.0] + [1.0] * (ITERATIONS - 1)
    # The rollout generated ahead is not counted as consumed until it trains: no batch skipped or repeated.
    assert [m["data/batch_index"] for m in metrics] == list(range(ITERATIONS))
    assert [m["data/consumed_batches"] for m in metrics] == list(range(1, ITERATIONS + 1))
    versions = [m["weights_version"] for m in metrics]
    assert versions == list(range(int(versions[0]), int(versions[0]) + ITERATIONS))
    for m in metrics:
        assert 0 < m["actor/is_weight_mean"] <= CAP and 0 <= m["actor/is_clipfrac"] <= 1
        assert math.isfinite(m["actor/pg_loss"]) and m["timing/update"] > 0
        assert 0 <= m["timing/coordinator"] <= m["timing/all"]


def test_the_next_rollout_runs_before_its_own_step_starts(pipelined_run: tuple) -> None:
    """From iteration 2 on, the iteration's rollout ran during the previous step (its timeline starts and ends
    before the iteration's own start), and the step is shorter than its rollout plus its update."""
    proc, run_dir = pipelined_run
    assert proc.returncode == 0
    for m in read_metrics(run_dir)[1:]:
        assert m["timeline/rollout/start"] < m["timeline/rollout/end"] <= 0
        assert m["timeline/update/start"] >= 0


def test_a_deeper_pipeline_trains_every_batch_once_within_its_staleness(repo_root: Path, tiny_model_dir: Path,
                                                                        arith_prefix: Path, tmp_path_factory) -> None:
    """`max_staleness: 2`: a further rollout is generated only while the update runs, so how deep the pipeline gets
    depends on timing; whatever it does, every batch trains once and in order, no sample more than two versions
    behind (the coordinator's and the trainer's fence), and the data cursor leaves out every rollout ahead."""
    run_dir = tmp_path_factory.mktemp("pipelined2")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir,
                  "-o", "megatron_training.train_iters=4", "-o", "megatron_training.save_interval=1000",
                  "-o", "rlfabric.max_staleness=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["data/consumed_batches"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[0]["staleness/max"] == 0 and all(1 <= m["staleness/max"] <= 2 for m in metrics[1:])
    for m in metrics:
        assert 0 < m["actor/is_weight_mean"] <= CAP and math.isfinite(m["actor/pg_loss"])
