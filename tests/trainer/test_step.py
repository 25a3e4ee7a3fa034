"""Rows -> model inputs: response alignment, data-parallel shares, mini-batch order."""

from __future__ import annotations

import pytest
import torch

from services.trainer.step import (
    SequenceRows,
    dp_share,
    make_micro_batch,
    response_slices,
    scatter_response_rows,
)
from services.trainer.update import Experience, UpdateOptions, mini_batches


def _rows() -> SequenceRows:
    # Row 0: prompt [1, 2], response [3, 4, 5]; row 1: prompt [6], response [7].
    return SequenceRows(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([2, 1]), torch.tensor([3, 1]))


def test_micro_batch_aligns_logits_with_response_tokens():
    mb = make_micro_batch(_rows(), [0, 1])
    assert mb["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    # The logit at position t predicts token t + 1: response token 3 (index 2) comes from position 1.
    assert mb["resp_pos"].tolist() == [[1, 2, 3], [0, 0, 0]]
    assert mb["resp_tokens"].tolist() == [[3, 4, 5], [7, 0, 0]]
    assert mb["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb["attention_mask"].shape == (1, 1, 5, 5) and bool(mb["attention_mask"][0, 0, 0, 1])


def test_padding_rows_and_length_for_pipeline_shapes():
    mb = make_micro_batch(_rows(), [1], pad_rows_to=3, seq_len=6)
    assert mb["input_ids"].shape == (3, 6) and mb["rows"] == [1, -1, -1]
    assert mb["response_mask"].sum().item() == 1


def test_response_slices_unpack_flat_values():
    flat = torch.tensor([0.1, 0.2, 0.3, 0.9])
    assert torch.equal(response_slices(flat, _rows(), [1, 0], 3), torch.tensor([[0.9, 0, 0], [0.1, 0.2, 0.3]]))


def test_vectorised_micro_batch_matches_a_per_row_build_on_ragged_rows():
    g = torch.Generator().manual_seed(3)
    p, r = torch.randint(1, 7, (9,), generator=g), torch.randint(1, 9, (9,), generator=g)
    rows = SequenceRows(torch.randint(1, 50, (int((p + r).sum()),), generator=g), p, r)
    idx = [7, 2, 5, 0]
    mb = make_micro_batch(rows, idx, pad_rows_to=6)
    s, w = mb["input_ids"].shape[1], mb["resp_pos"].shape[1]
    assert (s, w) == (int((p + r)[idx].max()), int(r[idx].max()))
    for j, i in enumerate(idx):
        seq = rows.token_ids[rows.seq_offsets[i] : rows.seq_offsets[i + 1]].tolist()
        n, pl = int(r[i]), int(p[i])
        assert mb["input_ids"][j].tolist() == seq + [0] * (s - len(seq))
        assert mb["resp_pos"][j].tolist() == list(range(pl - 1, pl - 1 + n)) + [0] * (w - n)
        assert mb["resp_tokens"][j].tolist() == seq[pl:] + [0] * (w - n)
        assert mb["response_mask"][j].tolist() == [1.0] * n + [0.0] * (w - n)
    assert mb["input_ids"][4:].abs().sum() == 0 and mb["rows"] == [*idx, -1, -1]
    flat = torch.randn(rows.num_response_tokens, generator=g)
    sliced = response_slices(flat, rows, idx, w)
    for j, i in enumerate(idx):
        a, b = int(rows.resp_offsets[i]), int(rows.resp_offsets[i + 1])
        assert sliced[j, : b - a].tolist() == flat[a:b].tolist() and not sliced[j, b - a :].any()
    out = torch.full_like(flat, -1.0)
    scatter_response_rows(out, rows, [*idx, -1], torch.cat([sliced, torch.full((1, w), 9.0)]))
    written = torch.zeros_like(flat, dtype=torch.bool)
    for i in idx:
        written[rows.resp_offsets[i] : rows.resp_offsets[i + 1]] = True
    assert torch.equal(out[written], flat[written]) and bool((out[~written] == -1.0).all())


def test_rows_are_validated():
    with pytest.raises(ValueError, match="lengths add up to 4"):
        SequenceRows(torch.tensor([1, 2, 3]), torch.tensor([2]), torch.tensor([2]))
    with pytest.raises(ValueError, match="advantages has 1 values for 2 sequences"):
        Experience(_rows(), torch.zeros(1), None, None)
    with pytest.raises(ValueError, match="old_log_probs has 3 values for 4 response tokens"):
        Experience(_rows(), torch.zeros(2), torch.zeros(3), None)


def test_dp_shares_cover_every_row_once():
    shares = [list(dp_share(10, 3, r)) for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_mini_batches_shuffle_deterministically_per_step_and_epoch():
    opts = UpdateOptions(mini_batch_rows=4, shuffle_mini_batch=True, seed=1)
    a = mini_batches(8, opts, step=3, epoch=0)
    assert a == mini_batches(8, opts, step=3, epoch=0)
    assert a != mini_batches(8, opts, step=3, epoch=1)
    assert sorted(i for mb in a for i in mb) == list(range(8)) and all(len(mb) == 4 for mb in a)
    assert mini_batches(8, UpdateOptions(mini_batch_rows=4), 0, 0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="not a multiple of the mini-batch size 3"):
        mini_batches(8, UpdateOptions(mini_batch_rows=3), 0, 0)
