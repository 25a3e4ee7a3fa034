"""The distributed optimizer (`use_distributed_optimizer`, services/trainer/optimizer.py) at data parallel 2.

One run of tests/trainer/optimizer_checks.py on two gloo ranks: plain vs sharded optimizer over five updates (ten
optimizer steps) in fp32 and in bf16, bytes per rank, 2 + save + resume + 2 against 4 straight, the sharded
checkpoint resumed by the plain optimizer, and then read back by one rank alone (data parallel 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from optimizer_checks import run


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(2, tiny_model_dir, tmp_path_factory.mktemp("distributed_optimizer"))


def test_sharded_equals_plain_in_fp32(results):
    assert results["fp32_moved"] > 1e-4  # the weights did move
    assert results["fp32_param_diff"] < 1e-6
    plain, sharded = results["fp32_grad_norms"]
    assert sharded == pytest.approx(plain, rel=1e-5)  # the norm over DP shards and TP/PP is the whole norm


def test_sharded_equals_plain_in_bf16_with_fp32_masters(results):
    # Without clipping the two reduce and step the same numbers: bitwise equal.
    assert results["bf16_master_diff"] == 0.0
    assert results["bf16_param_diff"] == 0.0


def test_sharded_equals_plain_with_reuse_fp32_param(results):
    assert results["reuse_master_diff"] == 0.0 and results["reuse_param_diff"] == 0.0
    plain, sharded = results["memory_reuse"]["plain"], results["memory_reuse"]["sharded"]
    assert 0.49 < sharded["master"] / plain["master"] < 0.52
    assert plain["master"] * 2 == pytest.approx(results["memory"]["plain"]["master"], rel=0.01)  # 2 bytes, not 4


def test_each_rank_holds_half_the_masters_and_adam_state(results):
    plain, sharded = results["memory"]["plain"], results["memory"]["sharded"]
    ratio = (sharded["master"] + sharded["optimizer_states"]) / (plain["master"] + plain["optimizer_states"])
    assert 0.49 < ratio < 0.52, ratio
    assert sharded["params"] == plain["params"] and sharded["grads"] >= plain["grads"]
    fp32 = results["memory_fp32"]
    assert fp32["plain"]["master"] == fp32["sharded"]["master"] == 0  # fp32 weights are their own masters
    assert 0.49 < fp32["sharded"]["optimizer_states"] / fp32["plain"]["optimizer_states"] < 0.52


def test_sharded_resume_is_bitwise_the_continuous_run(results):
    assert results["resume_param_diff"] == 0.0
    assert results["resume_master_diff"] == 0.0
    # The plain optimizer resumes the same checkpoint (each rank takes the whole state). Not bitwise: plain and
    # sharded clip with grad norms equal to rel 1e-5, and in bf16 that can flip an element whose gradient is near 0,
    # whose Adam step then differs by up to 2 lr (measured: max 2.2e-4 at lr 2e-4 and mean 3.0e-7 on an AMD EPYC,
    # max < 1e-6 on earlier machines). Over all elements the mean difference stays far (> 100x) below what a lost
    # Adam state gives (the same resume with no_load_optim).
    diffs = {k: v for k, v in results.items() if k.startswith("resume_")}
    assert results["resume_unsharded_master_diff"] <= 2.5 * 2e-4, diffs
    assert results["resume_unsharded_master_mean_diff"] < 1e-6, diffs
    assert results["resume_fresh_adam_master_mean_diff"] > 100 * results["resume_unsharded_master_mean_diff"], diffs


def test_a_dp2_checkpoint_reshards_to_dp1(results):
    assert results["saved_dp"] == 2 and results["saved_distributed"] is True and results["reshard_step"] == 4
    assert results["reshard_state_diffs"] == [0.0, 0.0]  # sharded and plain, at DP 1


def test_the_yaml_key_reaches_the_trainer(repo_root: Path, tiny_model_dir: Path):
    from services.common.config import load_config
    from services.trainer.options import worker_options_from_config

    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
        f"actor_config.load={tiny_model_dir}", "megatron_training.use_distributed_optimizer=true"])
    opts, _ = worker_options_from_config(cfg, "actor")
    assert opts.optimizer.use_distributed_optimizer is True
    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[f"actor_config.load={tiny_model_dir}"])
    assert worker_options_from_config(cfg, "actor")[0].optimizer.use_distributed_optimizer is False
