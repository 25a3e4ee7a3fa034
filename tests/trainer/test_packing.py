"""Packed rows (use_remove_padding) and token-budget micro-batches (use_dynamic_bsz), services/trainer/packing.py.

Pure functions first (grouping, layout, loss weights, options), then real Megatron-core on CPU
(tests/trainer/packing_checks.py, a subprocess per world size): log-probs and update gradients of packed and
token-budget micro-batches against padded ones at TP 1, and at TP 2, PP 2 and DP 2 on two ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import run_ranks

from services.trainer.packing import (
    DEFAULT_MAX_PACKING_TOKENS,
    Packing,
    build_micro_batches,
    dp_groups,
    group_rows,
    loss_scales,
    make_packed_micro_batch,
    thd_available,
    token_budget_groups,
    unpack_response,
)
from services.trainer.step import SequenceRows, make_micro_batch


def _rows() -> SequenceRows:
    # Row 0: prompt [1, 2], response [3, 4, 5]; row 1: prompt [6], response [7]; row 2: prompt [8, 9], response [].
    return SequenceRows(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([2, 1, 2]), torch.tensor([3, 1, 0]))


def _ragged_rows(n: int, seed: int) -> SequenceRows:
    g = torch.Generator().manual_seed(seed)
    p, r = torch.randint(1, 9, (n,), generator=g), torch.randint(1, 30, (n,), generator=g)
    return SequenceRows(torch.randint(1, 100, (int((p + r).sum()),), generator=g), p, r)


# --- grouping --------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40), budget=st.integers(50, 200),
       max_rows=st.one_of(st.none(), st.integers(1, 8)), min_groups=st.integers(1, 6))
def test_groups_respect_both_budgets_and_hold_every_row_once(lengths, budget, max_rows, min_groups):
    groups = token_budget_groups(lengths, budget, max_rows, min_groups=min_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    assert max_rows is None or all(len(g) <= max_rows for g in groups)
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)
    lower = max(min_groups, -(-sum(lengths) // budget), -(-len(lengths) // max_rows) if max_rows else 1)
    assert min(lower, len(lengths)) <= len(groups) <= len(lengths)


def test_groups_use_the_fewest_micro_batches_and_balance_tokens():
    # 8 rows of 10 tokens, budget 40: two full groups; a 5-row cap makes it 2 as well, a 3-row cap 3.
    assert [len(g) for g in token_budget_groups([10] * 8, 40)] == [4, 4]
    assert [len(g) for g in token_budget_groups([10] * 8, 40, 3)] == [3, 3, 2]
    # Longest first into the lightest group: 30 | 20 + 10 rather than 30 + 10 | 20.
    assert token_budget_groups([30, 20, 10], 40, min_groups=2) == [[0], [1, 2]]


def test_a_row_longer_than_the_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"rl_config.update_max_packing_token_size=16"):
        group_rows(_ragged_rows(4, 0), [0, 1, 2, 3], 2, Packing(max_tokens=16, key_prefix="update"))
    with pytest.raises(ValueError, match="ref_dynamic_max_batch_size must be >= 1"):
        Packing(max_tokens=10, max_rows=0, key_prefix="ref")


def test_fixed_micro_batches_are_chunks_of_the_share_in_order():
    rows = _ragged_rows(7, 1)
    assert group_rows(rows, [6, 2, 0, 5, 1], 2, Packing()) == [[6, 2], [0, 5], [1]]
    assert dp_groups(rows, range(7), 3, Packing(), dp=2, dp_rank=1) == [[4, 5, 6]]


def test_every_data_parallel_rank_runs_as_many_micro_batches_as_the_busiest():
    # Rank 0's rows need 3 groups of <= 40 tokens, rank 1's only 1: rank 1 splits into 3 as well.
    lengths = torch.tensor([30, 30, 30, 5, 5, 5])
    rows = SequenceRows(torch.ones(int(lengths.sum()), dtype=torch.long), torch.ones(6, dtype=torch.long), lengths - 1)
    pk = Packing(max_tokens=40)
    assert dp_groups(rows, range(6), 1, pk, dp=2, dp_rank=0) == [[0], [1], [2]]
    assert dp_groups(rows, range(6), 1, pk, dp=2, dp_rank=1) == [[3], [4], [5]]
    assert dp_groups(rows, range(6), 1, pk, dp=1, dp_rank=0) == [[0, 3], [1, 4], [2, 5]]


def test_loss_weights_are_each_micro_batchs_share_of_the_rows():
    groups = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9], [10, 11]]
    scales = loss_scales(groups, Packing(max_tokens=100))
    assert scales == pytest.approx([1.0, 1.0, 4 / 3, 2 / 3])
    # After Megatron's 1 / num_micro_batches: weights rows_m / rows, summing to 1.
    assert [s / len(groups) for s in scales] == pytest.approx([3 / 12, 3 / 12, 4 / 12, 2 / 12])
    assert loss_scales(groups, Packing(remove_padding=True)) == [1.0] * 4


# --- packed layout ---------------------------------------------------------------------------------------------


def _allowed(segments: list[int]) -> torch.Tensor:
    n = len(segments)
    return torch.tensor([[segments[q] == segments[k] and k <= q for k in range(n)] for q in range(n)])


def test_thd_packing_is_one_row_with_the_sequence_boundaries():
    mb = make_packed_micro_batch(_rows(), [0, 1, 2], multiple=4, one_row=True)
    assert mb["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]  # 9 tokens padded to 12
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 0, 1, 2]]
    # Row 0's response [3, 4, 5] is predicted at positions 1..3, row 1's [7] at 5; row 2 has none.
    assert mb["resp_pos"].tolist() == [[1, 2, 3, 5]] and mb["resp_rows"].tolist() == [0, 0, 0, 0]
    assert mb["resp_tokens"].tolist() == [[3, 4, 5, 7]]
    assert mb["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert mb["attention_mask"] is None  # flash attention takes the boundaries instead
    assert mb["cu_seqlens"].tolist() == [0, 5, 7, 9, 12] and mb["max_seqlen"] == 5


def test_mask_packing_fills_rows_of_the_longest_sequence_with_a_block_diagonal_mask():
    # Lengths 5, 2, 2 into rows of 8 tokens (5 rounded up to 4s): [seq 0, seq 1, tail] and [seq 2, tail].
    mb = make_packed_micro_batch(_rows(), [0, 1, 2], multiple=4, one_row=False)
    assert mb["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert mb["resp_pos"].tolist() == [[1, 2, 3, 5]] and mb["resp_rows"].tolist() == [0, 0, 0, 0]
    assert mb["resp_tokens"].tolist() == [[3, 4, 5, 7]]
    assert mb["attention_mask"].shape == (2, 1, 8, 8)
    assert torch.equal(~mb["attention_mask"][0, 0], _allowed([0] * 5 + [1] * 2 + [3]))
    assert torch.equal(~mb["attention_mask"][1, 0], _allowed([2] * 2 + [4] * 6))
    # Asked for a larger shape (pipeline parallel): more columns and an empty row, each padding its own block.
    big = make_packed_micro_batch(_rows(), [1, 2], width=6, pack_rows=3, one_row=False)
    assert big["input_ids"].tolist() == [[6, 7, 8, 9, 0, 0], [0] * 6, [0] * 6]
    assert big["resp_pos"].tolist() == [[0]] and big["resp_rows"].tolist() == [0]


def test_unpacked_values_match_the_padded_layout_and_keep_the_gradient():
    rows = _ragged_rows(6, 2)
    idx = [4, 0, 3]
    padded = make_micro_batch(rows, idx)
    for one_row in (True, False):
        packed = make_packed_micro_batch(rows, idx, one_row=one_row)
        assert torch.equal(unpack_response(packed["resp_tokens"], packed), padded["resp_tokens"])
        assert torch.equal(packed["response_mask"], padded["response_mask"])
    values = torch.randn(packed["resp_pos"].shape, requires_grad=True)
    unpack_response(values, packed).sum().backward()
    assert torch.equal(values.grad, torch.ones_like(values))


def test_pipeline_parallel_micro_batches_share_one_shape():
    rows = _ragged_rows(9, 3)
    groups = group_rows(rows, range(9), 0, Packing(max_tokens=60, max_rows=4))
    assert len({len(g) for g in groups}) > 1
    (packed,) = {tuple(mb["input_ids"].shape) for mb in build_micro_batches(rows, groups, Packing(True), pp=2, tp=2)}
    (padded,) = {tuple(mb["input_ids"].shape) for mb in build_micro_batches(rows, groups, Packing(), pp=2, tp=2)}
    assert packed[1] % 2 == 0 and packed[1] >= rows.max_len()  # a multiple of TP, for sequence parallelism
    assert padded[0] == max(len(g) for g in groups) and padded[1] % 2 == 0 and padded[1] >= rows.max_len()


# --- options ---------------------------------------------------------------------------------------------------


def test_options_carry_each_pass_budget(repo_root: Path):
    from services.common.config import load_config
    from services.trainer.options import worker_options_from_config

    cfg = load_config(repo_root / "configs/grpo_tiny_cpu.yaml", overrides=[
        "rl_config.use_remove_padding=true", "rl_config.use_dynamic_bsz=true",
        "rl_config.actor_max_packing_token_size=1000", "rl_config.update_dynamic_max_batch_size=6",
        "rl_config.ref_max_packing_token_size=3000", "rl_config.max_packing_token_size=9999"])
    actor, _ = worker_options_from_config(cfg, "actor")
    ref, _ = worker_options_from_config(cfg, "reference")
    assert actor.forward_packing == Packing(True, 1000, None, "actor")
    # max_packing_token_size never reaches a pass (as upstream): unset per-pass budgets are 4096.
    assert actor.update.packing == Packing(True, DEFAULT_MAX_PACKING_TOKENS, 6, "update")
    assert ref.forward_packing == Packing(True, 3000, None, "ref")
    plain, _ = worker_options_from_config(load_config(repo_root / "configs/grpo_tiny_cpu.yaml"), "actor")
    assert plain.forward_packing == Packing(key_prefix="actor") and not plain.update.packing.dynamic


# --- real Megatron-core on CPU ---------------------------------------------------------------------------------


def _run_ranks(world: int, layouts: list[str], hf: Path, work: Path) -> dict[str, dict]:
    run_ranks("packing_checks.py", world, ["--hf", str(hf), "--work", str(work),
                                           *[a for lay in layouts for a in ("--layout", lay)]])
    return {lay: torch.load(work / f"packing_w{world}_tp{lay.split('x')[0]}_pp{lay.split('x')[1]}.pt",
                            weights_only=False) for lay in layouts}


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_ranks(1, ["1x1"], tiny_model_dir, tmp_path_factory.mktemp("packing1"))["1x1"]


@pytest.fixture(scope="module")
def checks(one_rank, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], dict]:
    """(world, "TPxPP") -> rank 0's results."""
    two = _run_ranks(2, ["2x1", "1x2", "1x1"], tiny_model_dir, tmp_path_factory.mktemp("packing2"))
    return {(1, "1x1"): one_rank} | {(2, k): v for k, v in two.items()}


LAYOUTS = [(1, "1x1"), (2, "2x1"), (2, "1x2"), (2, "1x1")]  # TP 1; TP 2; PP 2; DP 2


@pytest.mark.parametrize("key", LAYOUTS, ids=["tp1", "tp2", "pp2", "dp2"])
def test_packed_and_token_budget_log_probs_equal_padded(checks, key):
    r = checks[key]
    base, base_ent = r["log_probs"]["padded"], r["entropy"]["padded"]
    assert base.numel() > 100 and torch.isfinite(base).all() and (base < 0).all()
    for name in ("packed", "dynamic", "dynamic_packed"):
        torch.testing.assert_close(r["log_probs"][name], base, rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(r["entropy"][name], base_ent, rtol=1e-5, atol=0, msg=name)


@pytest.mark.parametrize("key", LAYOUTS, ids=["tp1", "tp2", "pp2", "dp2"])
def test_packed_update_gradients_and_loss_equal_padded_with_the_same_grouping(checks, key):
    r = checks[key]
    for case in ("fixed", "seq_mean_entropy", "dynamic"):
        assert r["grad_rel"][case] < 1e-5, (case, r["grad_rel"][case])
        padded, packed = r["metrics"][case]
        for k in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl"):
            assert packed[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-7), (case, k)


def test_token_budget_update_weights_micro_batches_by_their_rows(one_rank):
    r = one_rank
    assert [len(g) for g in r["dynamic_groups"]] == [3, 3, 4, 2]  # unequal: the weights matter
    # sum_m (rows_m / rows) * grad(token mean_m), computed one micro-batch at a time, is the update's gradient;
    # weighing the micro-batches equally is not.
    assert r["grad_rel"]["dynamic_vs_hand"] < 1e-5
    assert r["grad_rel"]["dynamic_vs_equal_weights"] > 1e-2


@pytest.mark.skipif(not thd_available(), reason="Megatron's THD path needs an accelerator with TransformerEngine")
def test_accelerators_pack_through_megatrons_thd_path(one_rank):
    # There `packed` ran as one row per micro-batch with PackedSeqParams (the equivalence tests above held).
    assert one_rank["thd"] and one_rank["packed_shapes"] and all(k == 1 for k, _ in one_rank["packed_shapes"])


def test_cpu_packs_with_masks_into_rows_of_the_longest_sequence(one_rank):
    if thd_available():
        pytest.skip("an accelerator with TransformerEngine packs through THD")
    assert not one_rank["thd"] and any(k > 1 for k, _ in one_rank["packed_shapes"])
