"""Where a run continues from when the actor trainer was resumed from a checkpoint but the journal has no record.

GRPO takes one prompt batch per iteration, so the data cursor follows from the trainer's iteration; DAPO's dynamic
sampling takes a varying number per iteration, so without the journal the cursor is unknown and the run must be
refused rather than silently re-train or skip data.
"""

from __future__ import annotations

import types

import pytest

from rlfabric.v1 import trainer_pb2
from services.coordinator.run import RunDriver


class _Actor:
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def Info(self, request, timeout=None):  # noqa: N802 - the gRPC stub's method name
        return trainer_pb2.TrainerInfo(iteration=self.iteration, weights_version=self.iteration)


class _Sync:
    def __init__(self) -> None:
        self.pushed: list[int] = []

    def push(self, version: int) -> None:
        self.pushed.append(version)


def _driver(dynamic_sampling: bool) -> RunDriver:
    driver = object.__new__(RunDriver)
    driver.run_id = "r1"
    driver.cfg = types.SimpleNamespace(actor_config=types.SimpleNamespace(global_batch_size=8))
    driver.settings = types.SimpleNamespace(filter_groups_enable=dynamic_sampling)
    return driver


def test_grpo_without_journal_continues_one_batch_per_iteration() -> None:
    sync = _Sync()
    iteration, consumed, version = _driver(False)._starting_point({}, _Actor(5), [], sync)
    assert (iteration, consumed) == (5, 5)
    assert version == 6 and sync.pushed == [6]


def test_dapo_without_journal_is_refused_naming_the_key() -> None:
    sync = _Sync()
    with pytest.raises(RuntimeError, match=r"iteration 5.*filter_groups_enable"):
        _driver(True)._starting_point({}, _Actor(5), [], sync)
    assert sync.pushed == []
