"""The coordinator's side of a streaming update (log_prob_stream.requests_as_log_probs_arrive): requests in the
order the reference answered, each built only once its samples' log-probs are in, and a failure kept, not raised
inside gRPC's request iterator."""

from __future__ import annotations

import numpy as np

from services.common.sequences import Sequences
from services.coordinator.errors import IterationError
from services.coordinator.log_prob_stream import requests_as_log_probs_arrive


class _Reference:
    """Stands in for a LogProbStream: the order samples came in, and which log-probs are in when waited for."""

    def __init__(self, arrival: list[str]) -> None:
        self.arrival = {x: i for i, x in enumerate(arrival)}
        self.log_probs: dict[str, np.ndarray] = {}
        self.waited: list[list[str]] = []

    def wait_for(self, sample_ids) -> None:
        self.waited.append(list(sample_ids))
        self.log_probs.update({x: np.zeros(1, np.float32) for x in sample_ids})


def _seqs(ids: list[str]) -> Sequences:
    return Sequences.from_lists(ids, [np.array([1, 2], np.int32)] * len(ids),
                                [np.array([3 + i], np.int32) for i in range(len(ids))])


def test_requests_follow_the_references_answers_and_wait_for_each_chunk():
    seqs = _seqs(["a", "b", "c", "d", "e"])
    ref = _Reference(["d", "b", "e", "a", "c"])
    built = []

    def request(part: Sequences):
        assert all(x in ref.log_probs for x in part.sample_ids)  # never before its log-probs are in
        built.append(part)
        return part.sample_ids

    out = list(requests_as_log_probs_arrive(ref, seqs, 2, request, []))
    assert out == [["d", "b"], ["e", "a"], ["c"]] and ref.waited == out
    # each row keeps its own tokens when reordered
    assert [int(response[0]) for p in built for _, response in p.split()] == [6, 4, 7, 3, 5]


def test_a_request_that_cannot_be_built_ends_the_stream_and_is_kept():
    failed: list[IterationError] = []

    def request(part: Sequences):
        if "c" in part.sample_ids:
            raise IterationError("reference: no log-probs for 1 samples (first: ['c'])")
        return part.sample_ids

    out = list(requests_as_log_probs_arrive(_Reference(["a", "b", "c", "d"]), _seqs(["a", "b", "c", "d"]), 2,
                                            request, failed))
    assert out == [["a", "b"]] and len(failed) == 1 and "first: ['c']" in str(failed[0])
