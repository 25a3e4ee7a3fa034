"""The Reward gRPC service on loopback: Score streams, failures per sample, auth, remote verifiers."""

import re
import time
import urllib.request

import grpc
import pytest

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_channel
from services.reward.remote import CircuitBreaker
from services.reward.verifiers.registry import BUILTIN_VERSION

TOKEN = "s3cret"  # the reward_worker fixture's token


def request(sample_id, response, ground_truth="4", verifiers=(("math_equiv", 1.0),), deadline_s=0.0, **kw):
    return reward_pb2.ScoreRequest(
        sample_id=sample_id, response=response, ground_truth=ground_truth, deadline_s=deadline_s,
        verifiers=[reward_pb2.VerifierSpec(name=n, weight=w) for n, w in verifiers], **kw)


def stub_for(worker, token=None):
    return reward_pb2_grpc.RewardStub(make_channel(worker.server.address, token=token))


def score_all(stub, requests, timeout=60):
    """Score as a simple client uses it: one sample per request message; the answers, flattened."""
    batches = (reward_pb2.ScoreRequestBatch(requests=[r]) for r in requests)
    return [response for reply in stub.Score(batches, timeout=timeout) for response in reply.responses]


def test_score_stream_scores_every_sample_with_provenance(reward_worker):
    requests = [request(f"s{i}", f"\\boxed{{{i}}}", verifiers=(("math_equiv", 1.0), ("acc", 0.5)))
                for i in range(40)]
    responses = score_all(stub_for(reward_worker), requests)
    by_id = {r.sample_id: r for r in responses}
    assert len(responses) == len(by_id) == 40
    for i in range(40):
        response = by_id[f"s{i}"]
        assert [s.verifier for s in response.scores] == ["math_equiv", "acc"]
        assert {s.version for s in response.scores} == {BUILTIN_VERSION}
        assert all(s.error == "" and s.latency_s >= 0 for s in response.scores)
        # right: 1*1 + 0.5*1 = 1.5; wrong: 1*0 + 0.5*(-0.5) = -0.25
        assert response.reward == pytest.approx(1.5 if i == 4 else -0.25)
        assert response.worker_id == reward_worker.worker_id


def test_misbehaving_verifiers_cost_only_their_samples(reward_worker):
    bad = {
        "hang": ("sleep_forever", "hang"),
        "raise": ("raise_error", "raise"),
        "nan": ("return_nan", "nan"),
        "kill": ("kill_process", "kill"),
    }
    requests = [request(f"ok{i}", f"\\boxed{{{i % 5}}}") for i in range(30)]
    requests += [request(name, text, verifiers=((verifier, 1.0),), deadline_s=1.0)
                 for name, (verifier, text) in bad.items()]
    started = time.monotonic()
    responses = {r.sample_id: r for r in score_all(stub_for(reward_worker), requests)}
    assert len(responses) == 34
    assert [responses[f"ok{i}"].reward for i in range(30)] == [1.0 if i % 5 == 4 else 0.0 for i in range(30)]
    for name, reason in (("hang", "timeout"), ("raise", "exception"), ("nan", "non_finite"), ("kill", "crash")):
        score = responses[name].scores[0]
        assert (score.score, responses[name].reward) == (0.0, 0.0)
        assert score.error.startswith(reason + ":"), score.error
    # One hanging sample costs its 1 s deadline (plus a process restart), not the worker default of 5 s.
    assert time.monotonic() - started < 30


def test_unknown_verifier_is_invalid_argument(reward_worker):
    with pytest.raises(grpc.RpcError) as info:
        score_all(stub_for(reward_worker), [request("x", "\\boxed{1}", verifiers=(("nope", 1.0),))], timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown verifier 'nope'" in info.value.details() and "math_equiv" in info.value.details()


def test_list_verifiers(reward_worker):
    reply = stub_for(reward_worker).ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=10)
    names = [v.name for v in reply.verifiers]
    assert names[:2] == ["math_equiv", "math_17k_acc"]
    assert {"acc_for_dapo", "math_verify_reward", "sleep_forever", "kill_process"} <= set(names)
    assert all(v.builtin for v in reply.verifiers[:9])


def test_register_requires_the_token(reward_worker):
    register = reward_pb2.RegisterVerifierRequest(name="tokentest", version="1", endpoint="127.0.0.1:9")
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as info:
            stub_for(reward_worker, token=token).RegisterVerifier(register, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub_for(reward_worker).UnregisterVerifier(reward_pb2.UnregisterVerifierRequest(name="x"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    authed = stub_for(reward_worker, token=TOKEN)
    with pytest.raises(grpc.RpcError) as info:
        authed.RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="acc", endpoint="127.0.0.1:9"), timeout=10)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as info:
        authed.RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="Bad Name", endpoint="x:1"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        authed.UnregisterVerifier(reward_pb2.UnregisterVerifierRequest(name="never_registered"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_external_verifier_registered_later_is_used_by_a_running_worker(reward_worker, redis_url,
                                                                        external_verifier):
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    # Register through another worker: only Redis connects the two.
    with RewardWorker(RewardWorkerOptions(redis_url=redis_url, auth_token=TOKEN)) as other:
        stub_for(other, token=TOKEN).RegisterVerifier(reward_pb2.RegisterVerifierRequest(
            name="last_number", version="2024.1", endpoint=external_verifier, timeout_s=5), timeout=10)
    try:
        stub = stub_for(reward_worker)
        deadline = time.monotonic() + 10
        while "last_number" not in [v.name for v in stub.ListVerifiers(reward_pb2.ListVerifiersRequest()).verifiers]:
            assert time.monotonic() < deadline, "the running worker never saw the registration"
            time.sleep(0.1)
        requests = [request(f"r{i}", f"so the total is {i}", ground_truth="3",
                            verifiers=(("last_number", 2.0), ("math_equiv", 1.0))) for i in range(10)]
        responses = {r.sample_id: r for r in score_all(stub, requests)}
        for i in range(10):
            remote_score = responses[f"r{i}"].scores[0]
            assert (remote_score.verifier, remote_score.version, remote_score.error) == ("last_number", "2024.1", "")
            assert remote_score.score == (1.0 if i == 3 else 0.0)
            assert responses[f"r{i}"].reward == (2.0 if i == 3 else 0.0)
    finally:
        stub_for(reward_worker, token=TOKEN).UnregisterVerifier(
            reward_pb2.UnregisterVerifierRequest(name="last_number"), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        score_all(stub_for(reward_worker), [request("gone", "1", verifiers=(("last_number", 1.0),))], timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unreachable_remote_verifier_costs_its_samples_and_opens_the_circuit(reward_worker):
    authed = stub_for(reward_worker, token=TOKEN)
    authed.RegisterVerifier(reward_pb2.RegisterVerifierRequest(
        name="down", version="1", endpoint="127.0.0.1:1", timeout_s=1, max_concurrency=1), timeout=10)
    try:
        requests = [request(f"d{i}", "\\boxed{4}", verifiers=(("down", 1.0), ("math_equiv", 1.0))) for i in range(8)]
        responses = score_all(stub_for(reward_worker), requests)
        assert len(responses) == 8
        errors = [r.scores[0].error.split(":")[0] for r in responses]
        assert all(r.scores[0].score == 0.0 for r in responses)
        assert set(errors) <= {"remote", "timeout", "circuit_open"} and "circuit_open" in errors
        assert all(r.scores[1].score == 1.0 and r.reward == 1.0 for r in responses)  # the rest still counts
    finally:
        authed.UnregisterVerifier(reward_pb2.UnregisterVerifierRequest(name="down"), timeout=10)


def test_circuit_breaker_states():
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=0.2)
    assert breaker.allow()
    breaker.record(False)
    assert breaker.allow() and not breaker.is_open
    breaker.record(False)
    assert breaker.is_open and not breaker.allow()
    time.sleep(0.25)
    assert breaker.allow()  # half-open: one trial
    assert not breaker.allow()  # ...and only one
    breaker.record(True)
    assert not breaker.is_open and breaker.allow()


def test_metrics_endpoint(reward_worker):
    score_all(stub_for(reward_worker), [request("m1", "\\boxed{4}")], timeout=30)
    text = urllib.request.urlopen(f"http://127.0.0.1:{reward_worker.server.metrics_port}/metrics", timeout=10).read()
    text = text.decode()
    for name in ("rlfabric_reward_scores_total", "rlfabric_reward_verification_seconds_bucket",
                 "rlfabric_reward_timeouts_total", "rlfabric_reward_errors_total", "rlfabric_reward_queue_depth"):
        assert name in text, name
    assert re.search(r'rlfabric_reward_scores_total\{verifier="math_equiv"\} [1-9]', text)


def test_batches_of_many_samples_answer_every_sample_once(reward_worker):
    # Batches of 1..9 samples, a hanging one among them: one answer per sample id, the same verdicts
    # as one-sample batches get, and answers grouped as they were ready (never more than were asked).
    sizes = [1, 9, 3, 7, 5]
    batches, number = [], 0
    for size in sizes:
        batch = []
        for _ in range(size):
            batch.append(request(f"b{number}", f"\\boxed{{{number % 6}}}"))
            number += 1
        batches.append(reward_pb2.ScoreRequestBatch(requests=batch))
    batches[2].requests.append(request("hang", "hang", verifiers=(("sleep_forever", 1.0),), deadline_s=1.0))
    replies = list(stub_for(reward_worker).Score(iter(batches), timeout=60))
    answers = [response for reply in replies for response in reply.responses]
    assert all(len(reply.responses) >= 1 for reply in replies)
    assert sorted(a.sample_id for a in answers) == sorted([f"b{i}" for i in range(number)] + ["hang"])
    by_id = {a.sample_id: a for a in answers}
    assert [by_id[f"b{i}"].reward for i in range(number)] == [1.0 if i % 6 == 4 else 0.0 for i in range(number)]
    assert by_id["hang"].scores[0].error.startswith("timeout:")


def test_a_batch_with_an_unknown_verifier_is_refused(reward_worker):
    batch = reward_pb2.ScoreRequestBatch(requests=[request("x", "\\boxed{1}", verifiers=(("nope", 1.0),))])
    with pytest.raises(grpc.RpcError) as info:
        list(stub_for(reward_worker).Score(iter([batch]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_empty_batch_is_refused_naming_the_field(reward_worker):
    """What a client built from an older proto sends (its samples in unknown fields): not an OK with nothing."""
    with pytest.raises(grpc.RpcError) as info:
        list(stub_for(reward_worker).Score(iter([reward_pb2.ScoreRequestBatch()]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ScoreRequestBatch.requests is empty" in info.value.details()


@pytest.mark.parametrize("char", ["x", "\u00e9"])  # a non-ASCII one costs up to 9 bytes percent-encoded
def test_a_huge_invalid_sample_id_is_invalid_argument_with_the_id_cut_short(reward_worker, char):
    sample_id = char * 20_000  # quoted whole, the status would pass gRPC's 8 KiB metadata limit
    with pytest.raises(grpc.RpcError) as info:
        score_all(stub_for(reward_worker), [request(sample_id, "\\boxed{1}", verifiers=())])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ScoreRequest.verifiers is empty" in info.value.details()
    assert len(info.value.details()) < 500 and "(20002 characters)" in info.value.details()
