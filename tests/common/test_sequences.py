"""decode(encode(x)) == x for flat sequence batches, and inconsistent batches are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfabric.v1 import trainer_pb2
from services.common.sequences import Sequences, split_response_values


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=0, max_size=6), st.integers(0, 2**40))
def test_round_trip(lengths: list[tuple[int, int]], version: int) -> None:
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 5000, p, dtype=np.int32) for p, _ in lengths]
    responses = [rng.integers(0, 5000, r, dtype=np.int32) for _, r in lengths]
    ids = [f"g{i // 2}/{i % 2}" for i in range(len(lengths))]
    seqs = Sequences.from_lists(ids, prompts, responses, version)
    back = Sequences.from_proto(trainer_pb2.SequenceBatch.FromString(seqs.to_proto().SerializeToString()))
    assert back.sample_ids == ids and back.weights_version == version
    for (p, r), p0, r0 in zip(back.split(), prompts, responses, strict=True):
        np.testing.assert_array_equal(p, p0)
        np.testing.assert_array_equal(r, r0)


def test_inconsistent_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="add up to 5 tokens"):
        Sequences(["a"], np.zeros(4, np.int32), np.array([2], np.int32), np.array([3], np.int32))
    with pytest.raises(ValueError, match="prompt of >= 1 token"):
        Sequences(["a"], np.zeros(3, np.int32), np.array([0], np.int32), np.array([3], np.int32))


def test_split_response_values() -> None:
    parts = split_response_values(np.arange(5, dtype=np.float32), [2, 0, 3])
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    with pytest.raises(ValueError, match="expected 5"):
        split_response_values(np.arange(4, dtype=np.float32), [2, 0, 3])


# Batches of up to 7 sequences (prompt 1-6 tokens, response 0-6), for take and select.
SMALL_BATCHES = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=7)


def _small_batch(lengths: list[tuple[int, int]]) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 100, p, dtype=np.int32) for p, _ in lengths]
    responses = [rng.integers(0, 100, r, dtype=np.int32) for _, r in lengths]
    return [f"s{i}" for i in range(len(lengths))], prompts, responses


@settings(max_examples=30, deadline=None)
@given(SMALL_BATCHES, st.data())
def test_take_equals_a_batch_of_the_same_sequences(lengths: list[tuple[int, int]], data) -> None:
    ids, prompts, responses = _small_batch(lengths)
    start = data.draw(st.integers(0, len(lengths)))
    stop = data.draw(st.integers(start, len(lengths) + 3))  # past the end is cut, as with list slices
    part = Sequences.from_lists(ids, prompts, responses, 7).take(start, stop)
    expected = Sequences.from_lists(ids[start:stop], prompts[start:stop], responses[start:stop], 7)
    assert part.sample_ids == expected.sample_ids and part.weights_version == 7
    np.testing.assert_array_equal(part.token_ids, expected.token_ids)
    np.testing.assert_array_equal(part.prompt_lengths, expected.prompt_lengths)
    np.testing.assert_array_equal(part.response_lengths, expected.response_lengths)


@settings(max_examples=30, deadline=None)
@given(SMALL_BATCHES, st.data())
def test_select_equals_a_batch_of_the_chosen_sequences_in_that_order(lengths: list[tuple[int, int]], data) -> None:
    ids, prompts, responses = _small_batch(lengths)
    masks = [np.arange(len(r)) % 2 == 0 for r in responses]
    order = data.draw(st.permutations(range(len(lengths))))[: data.draw(st.integers(0, len(lengths)))]
    got = Sequences.from_lists(ids, prompts, responses, 7, response_masks=masks).select(order)
    expected = Sequences.from_lists([ids[i] for i in order], [prompts[i] for i in order],
                                    [responses[i] for i in order], 7, response_masks=[masks[i] for i in order])
    assert got.sample_ids == expected.sample_ids and got.weights_version == 7
    for name in ("token_ids", "prompt_lengths", "response_lengths", "response_mask"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))
