"""Megatron's mixed precision in the trainer (services/trainer/optimizer.py), one gloo rank.

One run of tests/trainer/optimizer_checks.py at world 1 trains the tiny model five updates (ten optimizer steps)
three ways from the same weights: fp32, bf16 with fp32 masters (`bf16: true`), and pure bf16 (the baseline,
`OptimizerOptions(master_weights=False)`); then checks resume and offload in bf16. The learning rate (1e-5) is
below half a bf16 step of most weights, which is where fp32 masters matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from optimizer_checks import run

from services.trainer.reuse_fp32_param import join_master, split_master


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(1, tiny_model_dir, tmp_path_factory.mktemp("mixed_precision"))


def _norm(d: dict[str, torch.Tensor]) -> float:
    return sum(v.double().pow(2).sum() for v in d.values()).sqrt().item()


def _delta(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: after[k].double() - before[k].double() for k in after}


def test_bf16_keeps_fp32_masters_main_grads_and_adam_state(results):
    d = results["mixed_dtypes"]
    assert "torch.bfloat16" in d["params"]  # Megatron's local-spec norms stay fp32; they are stepped in place
    assert d["main_grad"] == d["master"] == d["adam"] == ["torch.float32"]
    pure = results["pure_dtypes"]
    assert pure["master"] == [] and pure["main_grad"] == ["torch.bfloat16"] and "torch.bfloat16" in pure["adam"]


def test_bf16_params_are_the_masters_cast_after_every_step(results):
    # So the weight sync and the checkpoint's model state carry exactly the masters cast to bf16.
    params, masters = results["mixed_params"], results["mixed_master"]
    assert params.keys() == masters.keys()
    for name, p in params.items():
        assert torch.equal(p, masters[name].to(p.dtype)), name


def test_master_updates_follow_fp32_and_pure_bf16_loses_them(results):
    ref = _delta(results["fp32_final"], results["fp32_init"])
    mixed = _delta(results["mixed_master"], results["mixed_initial_master"])
    pure = _delta(results["pure_final"], results["pure_init"])
    moved = _norm(ref)
    assert moved > 1e-2  # ten Adam steps of 1e-5 over ~1M weights
    mixed_err = _norm({k: mixed[k] - ref[k] for k in ref}) / moved
    pure_err = _norm({k: pure[k] - ref[k] for k in ref}) / moved
    # Measured: 0.04 (the bf16 forward's gradients) and 0.93 (most updates rounded away).
    assert mixed_err < 0.15, mixed_err
    assert pure_err > 0.6, pure_err
    assert _norm(pure) < 0.6 * moved


def test_memory_counts_masters_and_adam_state(results):
    m, f = results["mixed_memory"], results["fp32_memory"]
    assert m["params"] < 0.6 * f["params"]  # bf16 weights (fp32 norms aside)
    assert m["grads"] == f["grads"]  # fp32 main grads either way
    assert f["master"] == 0 and m["master"] == pytest.approx(m["params"] * 2, rel=0.01)
    assert m["optimizer_states"] == f["optimizer_states"]  # fp32 moments either way


def test_bf16_resume_is_bitwise_the_continuous_run(results):
    assert results["resumed_iteration"] == 2
    assert results["resume_param_diff"] == 0.0
    assert results["resume_master_diff"] == 0.0
    ck = results["ckpt_optimizer"]
    assert ck["format"] == "rlfabric-adam-fp32/1" and ck["step"] == 4 and ck["master_weights"] is True
    assert results["ckpt_master_dtypes"] == ["torch.float32"]


def test_offload_moves_masters_and_main_grads_and_brings_them_back(results):
    gone = results["offloaded_memory"]
    assert gone["params"] == gone["grads"] == gone["master"] == 0
    assert gone["optimizer_states"] < 1024  # only the step counters stay
    assert results["onloaded_bytes"] == results["offloaded_bytes"] > 0
    assert results["offload_param_diff"] == 0.0 and results["offload_master_diff"] == 0.0


def test_a_checkpoint_of_the_former_torch_adamw_state_still_loads(results):
    assert results["legacy_pieces"] > 10 and results["legacy_steps"] == {1.0}
    assert results["legacy_state_diff"] == 0.0


def _special_fp32() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    values = values[~torch.isnan(values)]
    ties = (torch.randint(-(2**15), 2**15, (1000,), generator=g, dtype=torch.int32) << 16) | 0x8000
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.0e38, -3.0e38, float("inf"), float("-inf"),
                             torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny], dtype=torch.float32)
    return torch.cat([values, ties.view(torch.float32)[~torch.isnan(ties.view(torch.float32))], specials])


def test_reuse_fp32_param_split_is_exact_and_rounds_to_nearest():
    x = _special_fp32()
    param = torch.empty(x.numel(), dtype=torch.bfloat16)
    residual = torch.empty(x.numel(), dtype=torch.int16)
    split_master(x, param, residual)
    assert torch.equal(join_master(param, residual).view(torch.int32), x.view(torch.int32))  # bit for bit
    low = x.view(torch.int32) & 0xFFFF
    rne = x.to(torch.bfloat16)
    tie = low == 0x8000
    assert int(tie.sum()) > 500
    # Nearest everywhere; torch's ties-to-even and the ties-away-from-zero split differ only at exact ties.
    assert torch.equal(param[~tie].view(torch.int16), rne[~tie].view(torch.int16))
    assert bool((param[tie].float().abs() >= x[tie].abs()).all())
    assert bool((param[tie].float().abs() > rne[tie].float().abs()).any())


def test_reuse_fp32_param_halves_master_bytes_and_follows_separate_masters(results):
    mixed, reuse = results["mixed_master"], results["reuse_master"]
    init = results["mixed_initial_master"]
    moved = _norm(_delta(mixed, init))
    assert _norm({k: reuse[k].double() - mixed[k].double() for k in mixed}) < 0.05 * moved
    for name, p in results["reuse_params"].items():  # the parameters are the masters rounded as split_master does
        if p.dtype == torch.bfloat16:
            expect = torch.empty(p.numel(), dtype=torch.bfloat16)
            split_master(reuse[name].cpu().reshape(-1).contiguous(), expect, torch.empty(p.numel(), dtype=torch.int16))
            assert torch.equal(p.cpu().reshape(-1), expect), name  # .cpu(): the device check's results are on a GPU
    mem, sep = results["reuse_memory"], results["mixed_memory"]
    assert mem["master"] * 2 == pytest.approx(sep["master"], rel=0.01)
    assert mem["optimizer_states"] == sep["optimizer_states"] and mem["params"] == sep["params"]
    assert results["reuse_resume_param_diff"] == 0.0 and results["reuse_resume_master_diff"] == 0.0


def test_an_optimizer_built_later_owns_the_model_gradients(results):
    assert results["second_grad_sq"] > 0 and results["second_worker_grad_sq"] == 0.0
    assert results["second_moved"] == 0.0  # lr 0: the weights stay put
