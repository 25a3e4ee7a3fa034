"""The reference pass's micro-batches: as samples arrive, or, under `rlfabric.deterministic`, cut in sample order
once the last one is in (generation.LogProbStream; the trainer stub only records what it is sent)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rlfabric.v1 import common_pb2
from services.common.config import load_config
from services.common.tensors import to_proto
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.log_prob_stream import LogProbStream
from services.coordinator.settings import settings_from_config

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
ARRIVAL = ["g1/3", "g0/0", "g1/0", "g0/2", "g0/1", "g1/1", "g1/2", "g0/3"]


class _RecordingTrainer:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def ComputeLogProbs(self, requests, timeout):  # noqa: N802 - the gRPC method's name
        for r in requests:
            self.batches.append(list(r.batch.sample_ids))
        return iter(())


def _sample(sample_id: str) -> common_pb2.Sample:
    return common_pb2.Sample(sample_id=sample_id, group_id=sample_id.split("/")[0], response_length=2,
                             response_token_ids=to_proto(np.array([4, 5], np.int32)))


@pytest.mark.parametrize("deterministic", [False, True])
def test_micro_batches_follow_arrival_or_sample_order(deterministic: bool) -> None:
    settings = dataclasses.replace(settings_from_config(load_config(GRPO)), deterministic=deterministic)
    trainer = _RecordingTrainer()
    stream = LogProbStream("reference_model", trainer, settings, 3, PhaseClock())
    for sample_id in ARRIVAL:
        stream.add(_sample(sample_id), np.array([1, 2], np.int32), 0)
    stream.flush(0)
    stream.join()
    order = sorted(ARRIVAL) if deterministic else ARRIVAL
    assert trainer.batches == [order[0:3], order[3:6], order[6:8]]
