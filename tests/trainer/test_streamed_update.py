"""The streaming Update (services/trainer/streamed_update.py): two real single-rank trainers from the same weights,
one sent each call whole (no batch_rows), the other the same requests with batch_rows, so that it starts on the
first: the same metrics and the same weights, bit for bit, and a stream that breaks its batch_rows changes nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.sequences import Sequences
from services.common.tensors import to_numpy, to_proto
from services.trainer.streamed_update import ExperienceStream


@pytest.fixture(scope="module")
def pair(start_trainer, tiny_model_dir: Path):
    args = ("--hf-dir", str(tiny_model_dir), "--lr", "1e-3", "--kl-coef", "0.01", "--micro-batch-size", "2",
            "--forward-micro-batch-size", "8")
    channels = [grpc.insecure_channel(start_trainer(*args)[1]) for _ in range(2)]
    try:
        yield [trainer_pb2_grpc.TrainerStub(c) for c in channels]
    finally:
        for c in channels:
            c.close()


def _parts(step: int, sizes: list[int], seed: int, batch_rows: int = 0) -> list[trainer_pb2.UpdateRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for k, n in enumerate(sizes):
        seqs = Sequences.from_lists([f"s{seed}-{k}-{i}" for i in range(n)], [rng.integers(0, 4096, 4 + i % 2)
                                                                             for i in range(n)],
                                    [rng.integers(0, 4096, 3 + (i + k) % 4) for i in range(n)], step - 1)
        tokens = int(seqs.response_lengths.sum())
        out.append(trainer_pb2.UpdateRequest(
            batch=seqs.to_proto(), step=step, temperature=0.9, batch_rows=batch_rows,
            advantages=to_proto(rng.normal(size=n).astype(np.float32)),
            ref_log_probs=to_proto(-rng.uniform(0.5, 3.0, tokens).astype(np.float32))))
    return out


def _with_batch_rows(parts: list[trainer_pb2.UpdateRequest], rows: int) -> list[trainer_pb2.UpdateRequest]:
    out = []
    for p in parts:
        q = trainer_pb2.UpdateRequest()
        q.CopyFrom(p)
        q.batch_rows = rows
        out.append(q)
    return out


def _probe(stub) -> np.ndarray:
    rng = np.random.default_rng(99)
    seqs = Sequences.from_lists([f"p{i}" for i in range(3)], [rng.integers(0, 4096, 5) for _ in range(3)],
                                [rng.integers(0, 4096, 6) for _ in range(3)])
    reply = next(iter(stub.ComputeLogProbs(iter([trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=0.9)]),
                                           timeout=60)))
    return to_numpy(reply.log_probs)


def _loss_metrics(reply: trainer_pb2.UpdateResponse) -> dict[str, float]:
    return {k: v for k, v in reply.metrics.values.items() if not k.startswith(("timing/", "memory/"))}


def test_a_streamed_update_equals_the_collected_one_and_a_broken_stream_changes_nothing(pair):
    whole, streamed = pair
    assert np.array_equal(_probe(whole), _probe(streamed))  # the same weights to start with
    # 7 rows in parts of 3, 1, 3: micro-batches of 2 rows span parts, and the last one is short.
    parts = _parts(1, [3, 1, 3], seed=1)
    a = whole.Update(iter(parts), timeout=120)
    b = streamed.Update(iter(_with_batch_rows(parts, 7)), timeout=120)
    assert (a.num_tokens, a.weights_version) == (b.num_tokens, b.weights_version)
    assert _loss_metrics(a) == _loss_metrics(b) and _loss_metrics(a)["actor/kl_loss"] > 0
    after = _probe(whole)
    assert np.array_equal(after, _probe(streamed))

    # A stream that ends short of its batch_rows, or sends past it, fails before the optimizer step.
    second = _parts(2, [2, 4], seed=2)
    for rows, said in ((9, "ended after 6 rows"), (5, "more than batch_rows (5)")):
        with pytest.raises(grpc.RpcError) as err:
            streamed.Update(iter(_with_batch_rows(second, rows)), timeout=120)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in err.value.details()
        assert np.array_equal(_probe(streamed), after)
    # ... and leaves no gradient behind: the same step sent again still equals the whole call.
    a = whole.Update(iter(second), timeout=120)
    b = streamed.Update(iter(_with_batch_rows(second, 6)), timeout=120)
    assert _loss_metrics(a) == _loss_metrics(b)
    assert np.array_equal(_probe(whole), _probe(streamed)) and not np.array_equal(_probe(whole), after)


def test_the_stream_takes_parts_only_when_a_micro_batch_needs_their_rows_and_builds_only_those():
    pulled = []

    def parts():
        for k in range(3):
            pulled.append(k)
            yield k  # a part of 2 rows

    # `build` stands for the server's concatenation: here it says which parts it was given
    stream = ExperienceStream(parts(), total_rows=6, rows_of=lambda part: 2, build=list)
    assert stream.span(0, 1) == ([0], 0) and pulled == [0]
    assert stream.span(1, 2) == ([0], 1) and pulled == [0]
    assert stream.span(1, 3) == ([0, 1], 1) and pulled == [0, 1]  # a micro-batch across two parts
    assert stream.span(3, 4) == ([1], 1) and pulled == [0, 1]
    assert stream.whole() == [0, 1, 2] and pulled == [0, 1, 2]
