"""Full trainer steps of the tiny Qwen3-MoE at expert parallel 2 equal expert parallel 1 (tests/trainer/
moe_update_checks.py: two gloo ranks, data parallel 2, the trainer's TrainerWorker, log-probs then two Updates).

7 rows in micro-batches of 3: data-parallel rank 1 has one micro-batch fewer, so at EP 2 it runs a padding one (MoE
forwards and backwards are collectives of the EP group); the padding must change nothing, the router aux loss
(on) included. Experts' gradients are summed over the expert-data-parallel group and divided by DP, the gradient
norm counts each expert once, and the distributed optimizer shards experts over their own group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_log_probs
from moe_update_checks import ROWS, TEMPERATURE
from rank_checks import make_rows
from trainer_helpers import run_ranks

REFERENCE = "1:allgather:plain"
CASES = (REFERENCE, "2:allgather:plain", "2:alltoall:dist")


@pytest.fixture(scope="module")
def results(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("moe_update_work")
    cases = [arg for case in CASES for arg in ("--case", case)]
    run_ranks("moe_update_checks.py", 2, ["--hf", str(tiny_moe_dir), "--work", str(work), *cases], timeout_s=300)
    return {case: torch.load(work / f"moe_update_{case.replace(':', '_')}.pt", weights_only=False) for case in CASES}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


def test_log_probs_with_a_padding_micro_batch_equal_ep1_and_transformers(results, tiny_moe_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    expected = hf_log_probs(hf, make_rows(hf.config.vocab_size, 1, n=ROWS), TEMPERATURE)
    for case in CASES:
        got = results[case]["log_probs"]
        assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-5, case
        assert (got - results[REFERENCE]["log_probs"]).abs().max().item() < 1e-6, case


@pytest.mark.parametrize("case", CASES[1:])
def test_ep2_update_equals_ep1(results, case: str) -> None:
    ref, got = results[REFERENCE], results[case]
    experts = [n for n in ref["params"] if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 2  # layers x experts x (fc1, fc2): every expert came back
    diff, name = _max_diff(ref["params"], got["params"])
    assert diff < 1e-6, (name, diff)
    if got["grads"]:  # the plain optimizer keeps the reduced, clipped main grads of the last step
        diff, name = _max_diff(ref["grads"], got["grads"])
        assert diff < 1e-7, (name, diff)
        assert max(g.abs().max().item() for g in ref["grads"].values()) > 1e-4
    for m_ref, m_got in zip(ref["metrics"], got["metrics"], strict=True):
        for key in ("grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "moe/aux_loss",
                    "moe/expert_load_max_over_mean"):
            assert m_got[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), (key, m_ref[key], m_got[key])


def test_update_metrics_carry_moe_metrics(results) -> None:
    for case in CASES:
        for m in results[case]["metrics"]:
            assert 0.9 < m["moe/aux_loss"] < 3.0  # switch aux loss without its coefficient: 1.0 when balanced
            assert m["moe/expert_load_max_over_mean"] >= 1.0
            assert m["grad_norm"] > 0.05  # above clip_grad: the step was clipped by the norm


def test_padding_micro_batches_even_out_the_data_parallel_ranks() -> None:
    from services.trainer import packing

    rows = make_rows(64, 1, n=ROWS)
    fixed, dynamic = packing.Packing(), packing.Packing(max_tokens=20, key_prefix="update")
    # 7 rows, micro-batches of 3: rank 0 holds rows 0-3 (two micro-batches), rank 1 rows 4-6 (one).
    assert packing.dp_groups(rows, range(ROWS), 3, fixed, dp=2, dp_rank=1) == [[4, 5, 6]]
    assert packing.dp_groups(rows, range(ROWS), 3, fixed, dp=2, dp_rank=1, same_count=True) == [[4, 5, 6], []]
    assert packing.dp_groups(rows, range(ROWS), 3, fixed, dp=2, dp_rank=0, same_count=True) == [[0, 1, 2], [3]]
    # 1 row over 2 ranks: rank 1 has none, and still runs one (padding) micro-batch.
    assert packing.dp_groups(rows, [5], 3, dynamic, dp=2, dp_rank=1, same_count=True) == [[]]
    # Megatron divides by all micro-batches; the real ones weigh 2 / 1 so the loss is as without padding.
    assert packing.loss_scales([[4, 5, 6], []], fixed) == [2.0, 0.0]
    assert packing.loss_scales([[0, 1], [2]], dynamic) == pytest.approx([4 / 3, 2 / 3])
    assert packing.loss_scales([[0, 1], [2], []], dynamic) == pytest.approx([2.0, 1.0, 0.0])  # x 3 / 2
    mbs = packing.build_micro_batches(rows, [[4, 5, 6], []], fixed, pp=1)
    assert mbs[1]["padding"] and mbs[1]["rows"] == [-1] and float(mbs[1]["response_mask"].sum()) == 0.0
    assert "padding" not in mbs[0] and mbs[0]["rows"] == [4, 5, 6]
