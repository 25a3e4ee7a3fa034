"""A synchronous run with verl's keys through the real CLI: `rlfabric up` on configs/grpo_tiny_cpu.yaml with the
rollout correction on (token TIS and token_k1 rejection), GSPO and the REINFORCE++-baseline estimator.

The tiny config makes one optimizer step per iteration, so the old-log-prob pass is skipped: the rollout's
log-probs must still travel to the trainer, which corrects against its own current log-probs and measures the
mismatch itself. Every iteration must log `rollout_mismatch/{mean_abs_logp_diff,kl,max_ratio,masked_fraction}`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.test_grpo_run import read_metrics, run_up

ITERATIONS = 2
THRESHOLD = 2.0


@pytest.fixture(scope="module")
def corrected_run(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, tmp_path_factory) -> tuple:
    run_dir = tmp_path_factory.mktemp("corrected")
    proc = run_up(repo_root, tiny_model_dir, arith_prefix, run_dir,
                  "-o", f"megatron_training.train_iters={ITERATIONS}", "-o", "megatron_training.save_interval=1000",
                  "-o", "rlfabric.rollout_is=token", "-o", f"rlfabric.rollout_is_threshold={THRESHOLD}",
                  "-o", "rlfabric.rollout_rs=token_k1", "-o", "rlfabric.rollout_rs_threshold=0.5_2.0",
                  "-o", "rlfabric.policy_loss_mode=gspo", "-o", "rl_config.adv_estimator=reinforce_plus_plus_baseline")
    return proc, run_dir


@pytest.mark.slow  # about a minute on two cores: soak (`make soak`)
def test_every_iteration_logs_the_mismatch_and_the_correction(corrected_run: tuple) -> None:
    proc, run_dir = corrected_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
    for m in metrics:
        assert 0 <= m["rollout_mismatch/masked_fraction"] <= 1
        assert m["rollout_mismatch/mean_abs_logp_diff"] >= 0 and m["rollout_mismatch/kl"] >= 0
        assert m["rollout_mismatch/max_ratio"] > 0
        # a kept token's ratio is within the rejection bounds; truncation caps the weights
        assert 0 < m["actor/is_weight_mean"] <= THRESHOLD and 0 <= m["actor/is_clipfrac"] <= 1
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["grad_norm"])
