"""DAPO dynamic sampling: which groups are kept, accumulation across batches, and giving up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.dynamic_sampling import (
    DynamicSamplingExhaustedError,
    GroupAccumulator,
    groups_with_spread,
    select_metric,
)


def test_groups_with_spread_by_hand():
    # n = 3: [1,1,1] all right -> drop; [0,1,0] -> keep; [0,0,0] all wrong -> drop;
    # [0.1,0.1,0.1] equal (its computed std is a 1e-17 residue, still "no spread") -> drop
    values = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.1, 0.1, 0.1]
    assert np.std([0.1, 0.1, 0.1]) > 0  # why the test is max != min, not std > 0
    assert groups_with_spread(values, 3).tolist() == [False, True, False, False]


def test_group_of_one_is_kept():
    assert groups_with_spread([1.0, 0.0, 1.0], 1).tolist() == [True, True, True]


def test_accumulates_until_full_and_drops_the_surplus():
    acc: GroupAccumulator[str] = GroupAccumulator(train_batch_size=3, n_samples_per_prompt=2, max_batches=5)
    # batch 1: groups a..d, metric pairs (1,1) (0,1) (0,0) (1,0): keeps b, d
    assert acc.add(["a", "b", "c", "d"], [1, 1, 0, 1, 0, 0, 1, 0]) == 2
    assert not acc.ready and acc.num_kept == 2
    # batch 2: e..h with (0,1) (1,1) (1,0) (0,0): keeps e, g -> 4 kept, 3 needed
    assert acc.add(["e", "f", "g", "h"], [0, 1, 1, 1, 1, 0, 0, 0]) == 2
    assert acc.ready
    batch = acc.take()
    assert batch.groups == ["b", "d", "e"]  # first come, first kept; g is dropped
    assert (batch.num_gen_batches, batch.num_groups_seen, batch.num_groups_kept) == (2, 8, 4)
    # the accumulator starts afresh for the next iteration
    assert acc.num_kept == 0 and acc.num_gen_batches == 0 and not acc.ready


def test_gives_up_after_max_batches_with_a_clear_error():
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=2, n_samples_per_prompt=2, max_batches=2)
    acc.add([0, 1], [1, 1, 0, 0])
    with pytest.raises(DynamicSamplingExhaustedError) as info:
        acc.add([2, 3], [0, 1, 1, 1])  # one kept, still short after the second (last) batch
    message = str(info.value)
    assert "kept 1 of the 2 prompts" in message
    assert "filter_groups_max_batches=2" in message
    assert "3 of 4 groups had no spread" in message


def test_max_batches_zero_means_no_limit():
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=1, n_samples_per_prompt=2, max_batches=0)
    for _ in range(50):
        acc.add([0], [1, 1])
    acc.add([1], [0, 1])
    assert acc.take().num_gen_batches == 51


def test_no_limit_stops_when_the_data_runs_out():
    # max_batches -1 (no limit) over data of 3 batches: 3 batches without a full batch is one pass over every
    # prompt; a fourth would only sample the same prompts again, so it stops there, naming the data.
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=2, n_samples_per_prompt=2, max_batches=-1,
                                                  data_batches=3)
    acc.add([0], [1, 1])
    acc.add([1], [0, 1])
    with pytest.raises(DynamicSamplingExhaustedError, match="every prompt of the data set once") as info:
        acc.add([2], [0, 0])
    assert "kept 1 of the 2 prompts" in str(info.value) and "after 3 generation batches" in str(info.value)


def test_an_explicit_limit_is_not_bounded_by_the_data():
    # filter_groups_max_batches 4 over data of 2 batches: the config asked for 4 batches (re-sampling prompts).
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=1, n_samples_per_prompt=2, max_batches=4,
                                                  data_batches=2)
    for _ in range(3):
        acc.add([0], [1, 1])
    acc.add([1], [0, 1])
    assert acc.take().num_gen_batches == 4


def test_filling_on_the_last_allowed_batch_is_fine():
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=1, n_samples_per_prompt=2, max_batches=2)
    acc.add([0], [1, 1])
    acc.add([1], [0, 1])
    assert acc.take().groups == [1]


def test_misuse_raises():
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=2, n_samples_per_prompt=2)
    with pytest.raises(RuntimeError, match="before the batch is full"):
        acc.take()
    with pytest.raises(ValueError, match="3 groups but 4 metric values"):
        acc.add([0, 1, 2], [0, 1, 0, 1])
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=2"):
        acc.add([0, 1], [0, 1, 0])
    with pytest.raises(ValueError, match="non-finite"):
        acc.add([0], [0.0, float("nan")])
    with pytest.raises(ValueError, match="filter_groups_train_batch_size"):
        GroupAccumulator(train_batch_size=0, n_samples_per_prompt=2)


def test_select_metric():
    metrics = {"rewards": [1.0, 0.0], "math_17k_acc": [1.0, 1.0]}
    assert select_metric(metrics, "math_17k_acc").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"'acc'.*available: \['math_17k_acc', 'rewards'\]"):
        select_metric(metrics, "acc")


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(2, 5),
    groups=st.lists(st.lists(st.integers(0, 2), min_size=5, max_size=5), min_size=1, max_size=6),
    target=st.integers(1, 4),
)
def test_kept_iff_not_constant(n, groups, target):
    values = [v for g in groups for v in g[:n]]
    keep = groups_with_spread(values, n)
    assert keep.tolist() == [len(set(g[:n])) > 1 for g in groups]
    acc: GroupAccumulator[int] = GroupAccumulator(train_batch_size=target, n_samples_per_prompt=n)
    acc.add(list(range(len(groups))), values)
    expected = [i for i, k in enumerate(keep) if k]
    assert acc.ready == (len(expected) >= target)
    if acc.ready:
        assert acc.take().groups == expected[:target]
