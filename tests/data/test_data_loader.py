"""The prompt loader: length filter, seeded drop_last batches, labels beside prompts, exact resume."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import DataError
from services.coordinator.prompt_loader import PromptLoader


@pytest.fixture(scope="module")
def lengths(deepscaler_prefix) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(f"{deepscaler_prefix}_packed_input_ids_document")
    return np.array(ds.sequence_lengths)


def _same(a, b) -> bool:
    return (a.batch_index == b.batch_index and a.epoch == b.epoch
            and np.array_equal(a.prompt_indices, b.prompt_indices)
            and all(np.array_equal(x, y) for x, y in zip(a.prompts, b.prompts, strict=True))
            and all(np.array_equal(x, y) for x, y in zip(a.labels, b.labels, strict=True)))


def test_prompts_at_or_over_max_length_are_dropped_and_counted(deepscaler_prefix, lengths):
    max_len = int(np.percentile(lengths, 75))
    loader = PromptLoader(deepscaler_prefix, global_batch_size=32, max_prompt_length=max_len, seed=1)
    expected_dropped = int((lengths >= max_len).sum())
    assert loader.dropped_too_long == expected_dropped > 0
    assert loader.num_prompts == 803 - expected_dropped
    assert loader.batches_per_epoch == loader.num_prompts // 32
    seen = set()
    for k in range(loader.batches_per_epoch):
        b = loader.batch(k)
        assert len(b.prompts) == len(b.labels) == 32 and b.epoch == 0
        assert max(b.prompt_lengths) < max_len
        assert [len(p) for p in b.prompts] == [int(lengths[i]) for i in b.prompt_indices]
        seen.update(int(i) for i in b.prompt_indices)
    # drop_last: one epoch uses distinct prompts, all of them but the remainder.
    assert len(seen) == loader.batches_per_epoch * 32 == loader.num_prompts - loader.num_prompts % 32


def test_batches_carry_each_prompts_own_tokens_and_labels(deepscaler_prefix, shared_data, decode, qwen_r1_prompt):
    import json

    rows = json.loads((shared_data / "deepscaler/deepscaler_subset803_meta-reason.json").read_text())
    b = PromptLoader(deepscaler_prefix, global_batch_size=8, max_prompt_length=100_000, seed=3).batch(5)
    for idx, prompt, label in zip(b.prompt_indices, b.prompts, b.labels, strict=True):
        assert decode(prompt) == qwen_r1_prompt(rows[idx]["problem"])
        assert decode(label) == rows[idx]["answer"]
        assert prompt.dtype == np.int32


def test_resumed_loader_yields_the_uninterrupted_sequence(deepscaler_prefix):
    kw = dict(global_batch_size=64, max_prompt_length=100_000, seed=1234)
    full = PromptLoader(deepscaler_prefix, **kw)
    assert full.batches_per_epoch == 12
    uninterrupted = [b for _, b in zip(range(30), full, strict=False)]  # crosses two epoch boundaries
    assert full.consumed_batches == 30
    for k in (0, 1, 11, 12, 13, 25):
        resumed = PromptLoader(deepscaler_prefix, consumed_batches=k, **kw)
        for expected, got in zip(uninterrupted[k:], resumed, strict=False):
            assert _same(expected, got), (k, expected.batch_index)
        assert resumed.consumed_batches == 30


def test_seed_and_epoch_change_the_order_but_not_the_set(deepscaler_prefix):
    kw = dict(global_batch_size=100, max_prompt_length=100_000)
    a, b = PromptLoader(deepscaler_prefix, seed=1, **kw), PromptLoader(deepscaler_prefix, seed=2, **kw)
    assert not np.array_equal(a.epoch_order(0), b.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert sorted(a.epoch_order(0)) == sorted(b.epoch_order(1)) == list(range(803))
    # The same seed gives the same order in a fresh loader.
    assert np.array_equal(a.epoch_order(3), PromptLoader(deepscaler_prefix, seed=1, **kw).epoch_order(3))


@settings(max_examples=25, deadline=None)
@given(gbs=st.integers(1, 200), seed=st.integers(0, 2**31), k=st.integers(0, 60))
def test_batch_k_is_a_pure_function_of_its_inputs(deepscaler_prefix, gbs, seed, k):
    kw = dict(global_batch_size=gbs, max_prompt_length=100_000, seed=seed)
    a = PromptLoader(deepscaler_prefix, **kw)
    for _ in range(k % 7):
        a.next_batch()
    b = PromptLoader(deepscaler_prefix, consumed_batches=a.consumed_batches, **kw)
    assert _same(a.next_batch(), next(iter(b)))
    assert np.array_equal(a.batch(k).prompt_indices, b.batch(k).prompt_indices)


def test_loader_errors(deepscaler_prefix, tmp_path):
    with pytest.raises(DataError, match="no prompt dataset at .*nothing_packed_input_ids_document"):
        PromptLoader(tmp_path / "nothing", global_batch_size=8, max_prompt_length=10, seed=0)
    with pytest.raises(DataError, match="fewer than one batch"):
        PromptLoader(deepscaler_prefix, global_batch_size=8, max_prompt_length=10, seed=0)
    with pytest.raises(DataError, match="global_batch_size must be >= 1"):
        PromptLoader(deepscaler_prefix, global_batch_size=0, max_prompt_length=10, seed=0)
