"""The pipelined mode's version fence and behaviour log-probs (services/coordinator/off_policy.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rlfabric.v1 import common_pb2, reward_pb2
from services.common.tensors import to_proto
from services.coordinator.errors import IterationError
from services.coordinator.generation import Group, GroupPrompt
from services.coordinator.off_policy import behavior_log_probs, fence


def _group(versions: list[int], lengths: list[int] | None = None) -> Group:
    lengths = lengths or [2] * len(versions)
    samples = [common_pb2.Sample(sample_id=f"g/{i}", group_id="g", index=i, weights_version=v, response_length=n,
                                 response_token_ids=to_proto(np.arange(n, dtype=np.int32)),
                                 response_log_probs=to_proto(np.full(n, -0.5 * (i + 1), np.float32)))
               for i, (v, n) in enumerate(zip(versions, lengths, strict=True))]
    return Group(GroupPrompt("g", np.array([1], np.int32), ""), samples,
                 [reward_pb2.ScoreResponse() for _ in samples])


def test_fence_reports_the_lag_of_the_trainable_samples() -> None:
    # actor at 7; samples at 6, 7, 6 and one empty response (not trainable) at 3: lags 1, 0, 1.
    metrics = fence([_group([6, 7, 6, 3], [2, 2, 2, 0])], actor_version=7, max_staleness=1)
    assert metrics == {"staleness/mean": pytest.approx(2 / 3), "staleness/max": 1.0}


@pytest.mark.parametrize(("versions", "bound"), [([5, 7], 1), ([7, 8], 1), ([6], 0)])
def test_fence_refuses_samples_outside_the_bound(versions: list[int], bound: int) -> None:
    with pytest.raises(IterationError, match=f"max_staleness allows 0..{bound}"):
        fence([_group(versions)], actor_version=7, max_staleness=bound)


def test_behaviour_log_probs_are_the_rollouts_per_sample() -> None:
    out = behavior_log_probs([_group([1, 1], [3, 1])])
    assert out["g/0"].tolist() == [-0.5, -0.5, -0.5] and out["g/1"].tolist() == [-1.0]


def test_a_sample_without_its_log_probs_is_refused() -> None:
    g = _group([1])
    g.samples[0].response_log_probs.CopyFrom(to_proto(np.zeros(1, np.float32)))
    with pytest.raises(IterationError, match="log-prob of every sampled token"):
        behavior_log_probs([g])
