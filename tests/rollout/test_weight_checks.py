"""The replica's checks of tensors larger than one cache-blocked step (services/rollout/weight_checks.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from rlfabric.v1 import common_pb2
from services.common.checksum import CHUNK_BYTES, combine_checksums
from services.rollout import weight_checks
from services.rollout.weight_checks import Verification
from services.rollout.weights import (
    ParamSpec,
    WeightDataLossError,
    WeightStager,
    WeightUpdateError,
    make_bucket,
)

NUMEL = 2 * CHUNK_BYTES // 4 + 7  # three steps, the last one short and not a whole number of words
SPECS = {"w": ParamSpec((NUMEL,), torch.float32)}


def test_non_finite_value_in_the_last_step_is_refused_naming_the_parameter() -> None:
    t = torch.ones(NUMEL)
    t[-1] = float("nan")
    with pytest.raises(WeightUpdateError, match=rf"parameter 'w' has 1 non-finite values .* flat index {NUMEL - 1}"):
        WeightStager(SPECS).add_bucket(make_bucket(1, 0, {"w": t}))


def test_finite_values_whose_step_sums_overflow_are_accepted() -> None:
    t = torch.full((NUMEL,), 3e38)
    bucket = make_bucket(1, 0, {"w": t})
    stager = WeightStager(SPECS)
    stager.add_bucket(bucket)
    staged = stager.commit(common_pb2.WeightCommit(version=1, num_buckets=1, checksum=combine_checksums([bucket.checksum])))
    assert torch.equal(dict(staged.tensors)["w"], t)


def test_a_corrupted_byte_in_the_last_step_is_data_loss() -> None:
    bucket = make_bucket(1, 0, {"w": torch.ones(NUMEL)})
    data = bytearray(bucket.tensors[0].tensor.data)
    data[-1] ^= 1
    bucket.tensors[0].tensor.data = bytes(data)
    with pytest.raises(WeightDataLossError, match="checksum"):
        WeightStager(SPECS).add_bucket(bucket)


def _verification(tensors: dict[str, torch.Tensor], sent_flip: int = 0) -> Verification:
    bucket = make_bucket(1, 0, tensors)
    specs = {name: ParamSpec(tuple(t.shape), torch.float32) for name, t in tensors.items()}
    return Verification(0, 1, bucket.checksum ^ sent_flip, list(tensors.items()), specs)


def _three(bad_at: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(5, generator=g) for i in range(3)}
    if bad_at is not None:
        tensors[f"w{bad_at}"][4] = float("inf")
    return tensors


def test_a_taken_bucket_nobody_verifies_is_checked_by_its_reader_in_order() -> None:
    tensors = _three()
    taken = _verification(tensors).take()  # the engine's side does every check
    assert [(name, t.tolist()) for name, t in taken] == [(name, t.tolist()) for name, t in tensors.items()]


def test_the_reader_stops_before_a_bad_tensor_it_checked_itself() -> None:
    got = []
    with pytest.raises(WeightUpdateError, match=r"parameter 'w1' has 1 non-finite values .* flat index 4"):
        for name, _ in _verification(_three(bad_at=1)).take():
            got.append(name)
    assert got == ["w0"]


def test_a_checksum_mismatch_wins_over_a_bad_value_whoever_checks() -> None:
    pending = _verification(_three(bad_at=0), sent_flip=1)
    with pytest.raises(WeightDataLossError, match="checksum"):
        list(pending.take())


@pytest.mark.parametrize("verifier_first", [True, False])
def test_the_commit_and_the_reader_share_the_checks_without_doing_one_twice(verifier_first: bool) -> None:
    pending = _verification(_three())
    calls = []
    original = weight_checks._checksum_and_finite

    def counted(tensor: torch.Tensor) -> tuple[int, bool]:
        calls.append(threading.current_thread().name)
        return original(tensor)

    weight_checks._checksum_and_finite = counted
    try:
        verifier = threading.Thread(target=pending.run, name="verifier")
        if verifier_first:
            verifier.start()
        taken = [name for name, _ in pending.take()]
        if not verifier_first:
            verifier.start()
        verifier.join()
    finally:
        weight_checks._checksum_and_finite = original
    assert taken == ["w0", "w1", "w2"]
    assert len(calls) == 3
    assert pending.result() == []  # taken: nothing kept, and no failure


def test_placed_tensors_land_in_their_destinations_checked_and_the_rest_are_yielded() -> None:
    tensors = _three()
    into = {"w0": torch.zeros(5), "w2": torch.zeros(5)}
    pending = _verification(tensors)
    yielded = [(name, t.tolist()) for name, t in pending.take().placing(into)]
    assert yielded == [("w1", tensors["w1"].tolist())]
    assert torch.equal(into["w0"], tensors["w0"]) and torch.equal(into["w2"], tensors["w2"])
    assert pending.result() == []  # every tensor passed, none kept


def test_a_placed_non_finite_tensor_fails_the_bucket_after_landing() -> None:
    into = {"w1": torch.zeros(5)}
    with pytest.raises(WeightUpdateError, match=r"parameter 'w1' has 1 non-finite values .* flat index 4\)$"):
        list(_verification(_three(bad_at=1)).take().placing(into))
    assert into["w1"][4] == float("inf")  # it landed: the caller's update fails midway (backup or refusal)


def test_a_placed_bucket_with_a_wrong_checksum_fails_after_its_last_tensor() -> None:
    tensors = _three()
    into = {name: torch.zeros(5) for name in tensors}
    with pytest.raises(WeightDataLossError, match="checksum"):
        list(_verification(tensors, sent_flip=1).take().placing(into))
    assert all(torch.equal(into[name], t) for name, t in tensors.items())


def test_a_destination_of_another_dtype_or_size_is_not_placed() -> None:
    tensors = _three()
    into = {"w0": torch.zeros(5, dtype=torch.float64), "w1": torch.zeros(4), "w2": torch.zeros(10)[::2]}
    yielded = [name for name, _ in _verification(tensors).take().placing(into)]
    assert yielded == ["w0", "w1", "w2"]
    assert not any(t.any() for t in into.values())
