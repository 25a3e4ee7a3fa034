"""Regressions of issue 12 on the reward path: score shifts, bad text, bad deadlines, a poisoned registry."""

import json
import math
import time

import grpc
import pytest

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_channel
from services.reward.pool import SampleClock, VerifierPool
from services.reward.wire import invalid_utf8_field

RIGHT_WRONG = ["\\boxed{4}", "\\boxed{5}", "\\boxed{4}", "\\boxed{5}"]


def sample(sample_id, response, deadline_s=0.0, verifiers=(("math_equiv", 1.0),), ground_truth="4"):
    return reward_pb2.ScoreRequest(sample_id=sample_id, response=response, ground_truth=ground_truth,
                                   deadline_s=deadline_s,
                                   verifiers=[reward_pb2.VerifierSpec(name=n, weight=w) for n, w in verifiers])


def score_one_by_one(stub, requests):
    """One stream per sample, as the tester's client did: the rewards in order."""
    rewards = []
    for request in requests:
        replies = list(stub.Score(iter([reward_pb2.ScoreRequestBatch(requests=[request])]), timeout=60))
        rewards.append([r.reward for reply in replies for r in reply.responses])
    return rewards


@pytest.fixture(scope="module")
def single_worker():
    """One pool process, so that every sample goes through the same pipe."""
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    with RewardWorker(RewardWorkerOptions(processes=1, metrics_port=None)) as worker:
        yield worker


@pytest.mark.parametrize("deadline_s", [math.inf, -math.inf, math.nan, 3e6, -1.0])
def test_a_bad_deadline_is_refused_and_later_samples_keep_their_own_scores(single_worker, deadline_s):
    stub = reward_pb2_grpc.RewardStub(make_channel(single_worker.server.address))
    with pytest.raises(grpc.RpcError) as info:
        score_one_by_one(stub, [sample("bad", "\\boxed{4}", deadline_s=deadline_s)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deadline_s" in info.value.details() and "'bad'" in info.value.details()
    # Issue 12 saw 1,1,0,1 here: the bad sample's verdict was left in the pipe and handed on.
    assert score_one_by_one(stub, [sample(f"s{i}", text) for i, text in enumerate(RIGHT_WRONG)]) == [
        [1.0], [0.0], [1.0], [0.0]]


def test_the_pool_survives_a_deadline_beyond_its_timer_range():
    # 5e6 s is finite but past poll()'s millisecond range: it overflowed after the task had reached the
    # process, and the verdict stayed in the pipe for the next sample.
    with VerifierPool(1) as pool:
        assert pool.verify("math_equiv", "\\boxed{4}", "4", 5e6).score == 1.0
        assert [pool.verify("math_equiv", text, "4", 10.0).score for text in RIGHT_WRONG] == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        SampleClock(math.inf)


def test_a_slot_failure_after_the_batch_was_sent_recycles_the_process(faulty_plugins):
    # A callback that raises makes the slot fail while the rest of its batch is still in the process:
    # those verdicts must never reach later samples.
    with VerifierPool(1, plugins=faulty_plugins) as pool:
        # holds the process while the rest queue, so that they go in one batch (with 0.5 s the test failed once on
        # a loaded machine, most likely because the submissions had not all queued by then)
        blocker = pool.submit("sleepy", "2.0:x", "x", SampleClock(10.0))

        def explode(outcome):
            raise RuntimeError("caller bug")

        pool.submit_callback("math_equiv", "\\boxed{4}", "4", SampleClock(10.0), explode)
        failed = [pool.submit("math_equiv", text, "4", SampleClock(10.0)) for text in RIGHT_WRONG]
        assert blocker.result(timeout=30).score == 1.0
        for future, expected in zip(failed, [1.0, 0.0, 1.0, 0.0], strict=True):
            outcome = future.result(timeout=30)  # the failed batch's samples: a crash said so, or their own score
            assert outcome.reason == "crash" if outcome.reason else outcome.score == expected
        assert "crash" in [f.result().reason for f in failed]
        restarts = pool.restarts
        assert [pool.verify("math_equiv", text, "4", 10.0).score for text in RIGHT_WRONG] == [1.0, 0.0, 1.0, 0.0]
        assert restarts >= 1


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda r: r.verifiers.add(name="math_equiv", weight=math.nan), "weight of 'math_equiv' is nan"),
    (lambda r: r.ClearField("verifiers"), "ScoreRequest.verifiers is empty"),
    (lambda r: r.ClearField("sample_id"), "sample_id is empty"),
])
def test_malformed_samples_are_invalid_argument_naming_the_field(single_worker, mutate, match):
    request = sample("m", "\\boxed{4}", verifiers=())
    request.verifiers.add(name="acc", weight=1.0)
    mutate(request)
    stub = reward_pb2_grpc.RewardStub(make_channel(single_worker.server.address))
    with pytest.raises(grpc.RpcError) as info:
        score_one_by_one(stub, [request])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in info.value.details()


def _with_bad_utf8(message, marker: str) -> bytes:
    """`message` serialised, with the UTF-8 of `marker` replaced by as many invalid bytes."""
    data = message.SerializeToString()
    encoded = marker.encode()
    assert data.count(encoded) == 1
    return data.replace(encoded, b"\xff" * len(encoded))


def test_text_that_is_not_utf8_is_invalid_argument_naming_the_field(single_worker, reward_worker):
    channel = grpc.insecure_channel(single_worker.server.address)
    score = channel.stream_stream("/rlfabric.v1.Reward/Score", request_serializer=None,
                                  response_deserializer=reward_pb2.ScoreResponseBatch.FromString)
    batch = reward_pb2.ScoreRequestBatch(requests=[sample("a", "\\boxed{4}"), sample("b", "RESPONSE-B")])
    with pytest.raises(grpc.RpcError) as info:
        list(score(iter([_with_bad_utf8(batch, "RESPONSE-B")]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # was INTERNAL
    assert "ScoreRequestBatch.requests[1].response is not valid UTF-8" in info.value.details()
    # The unary registry RPCs parse the same way (the token is checked first).
    register = grpc.insecure_channel(reward_worker.server.address).unary_unary(
        "/rlfabric.v1.Reward/RegisterVerifier", request_serializer=None,
        response_deserializer=reward_pb2.RegisterVerifierResponse.FromString)
    bad = _with_bad_utf8(reward_pb2.RegisterVerifierRequest(name="NAME-X", endpoint="127.0.0.1:9"), "NAME-X")
    with pytest.raises(grpc.RpcError) as info:
        register(bad, timeout=10, metadata=(("authorization", "Bearer s3cret"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RegisterVerifierRequest.name is not valid UTF-8" in info.value.details()
    # The worker goes on scoring.
    stub = reward_pb2_grpc.RewardStub(make_channel(single_worker.server.address))
    assert score_one_by_one(stub, [sample("after", "\\boxed{4}")]) == [[1.0]]


def test_invalid_utf8_field_finds_nested_and_repeated_fields():
    batch = reward_pb2.ScoreRequestBatch(requests=[
        sample("a", "x"), sample("b", "y", verifiers=(("acc", 1.0), ("NAME-Z", 2.0)))])
    data = _with_bad_utf8(batch, "NAME-Z")
    assert invalid_utf8_field(reward_pb2.ScoreRequestBatch.DESCRIPTOR, data) == "requests[1].verifiers[1].name"
    assert invalid_utf8_field(reward_pb2.ScoreRequestBatch.DESCRIPTOR, batch.SerializeToString()) is None
    assert invalid_utf8_field(reward_pb2.ScoreRequestBatch.DESCRIPTOR, b"\x0a\xff") is None  # truncated: no name


def test_malformed_registry_entries_are_skipped_and_the_poll_thread_lives(redis_url, caplog):
    from services.common.redis_store import connect
    from services.reward.endpoints import EndpointPolicy
    from services.reward.remote import RemoteVerifiers
    from services.reward.verifier_store import RemoteVerifierEntry, VerifierStore
    from services.reward.verifiers.registry import VERIFIERS

    client = connect(redis_url)
    store = VerifierStore(client, prefix="poisoned")
    key = "poisoned:reward:verifiers"

    def entry(name, **fields):
        return json.dumps({"name": name, "version": "1", "endpoint": "127.0.0.1:9", **fields})

    remote = RemoteVerifiers(store, endpoints=EndpointPolicy.parse("loopback"), local_names=frozenset(VERIFIERS),
                             poll_s=0.1)
    try:
        client.hset(key, mapping={  # what anyone who can write Redis could leave there
            "garbage": "{not json", "list": "[1, 2]", "wrongtype": entry("wrongtype", version=1),
            "missing": json.dumps({"name": "missing"}), "renamed": entry("other"), "acc": entry("acc"),
            "badport": entry("badport", endpoint="127.0.0.1:x"), "nantimeout": entry("nantimeout", timeout_s=math.nan),
            "metadata": entry("metadata", endpoint="169.254.169.254:80"),
            "elsewhere": entry("elsewhere", endpoint="10.1.2.3:50070"),
        })
        client.incr(f"{key}:rev")
        store.register(RemoteVerifierEntry(name="good", version="1", endpoint="127.0.0.1:9"))
        deadline = time.monotonic() + 20
        while [e.name for e in remote.entries()] != ["good"]:
            assert time.monotonic() < deadline, [e.name for e in remote.entries()]
            time.sleep(0.1)
        client.set(f"{key}:rev", "not-a-number")  # even the revision counter may be garbage
        time.sleep(0.5)
        assert remote._thread.is_alive()
        assert [e.name for e in remote.entries()] == ["good"]
    finally:
        remote.close()
        client.delete(key, f"{key}:rev")
    logged = caplog.text
    for name in ("garbage", "list", "wrongtype", "missing", "renamed", "acc", "badport", "nantimeout"):
        assert f"{key}['{name}']" in logged, name
    assert "skipping the registered verifier metadata" in logged and "never allowed" in logged
    assert "skipping the registered verifier elsewhere" in logged and "--verifier-allow" in logged
