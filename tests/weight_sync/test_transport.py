"""The gRPC stream transport against real rollout servers: several targets, corruption, dead and silent targets."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch
import transformers
from weight_sync_helpers import PROMPTS, engine_parameters, hf_greedy_all, rollout_greedy, serve_rollout

from rlfabric.v1 import rollout_pb2
from services.common.checksum import combine_checksums
from services.common.transports import GrpcStreamTransport, TargetFailure, WeightAck
from services.trainer.convert import load_hf_state


def _version(stub) -> int:
    return stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version


def _flip_first_byte(chunk: rollout_pb2.WeightUpdateChunk) -> rollout_pb2.WeightUpdateChunk:
    bad = rollout_pb2.WeightUpdateChunk()
    bad.CopyFrom(chunk)
    data = bytearray(bad.bucket.tensors[0].tensor.data)
    data[0] ^= 0xFF
    bad.bucket.tensors[0].tensor.data = bytes(data)
    return bad


def test_one_push_reaches_every_target_and_failures_stay_isolated(rollout_engine, rollout_server, rollout_stub,
                                                                  tiny_model_dir):
    state = load_hf_state(tiny_model_dir)
    before = _version(rollout_stub)
    second = serve_rollout(rollout_engine)  # another endpoint over the same engine
    dead = "127.0.0.1:9"
    good, tampered = rollout_server[0].address, second.address
    events: list = []
    try:
        transport = GrpcStreamTransport(
            [good, tampered, dead], bucket_bytes=256 << 10, timeout_s=60,
            on_progress=lambda *e: events.append(e),
            tamper=lambda target, chunk: _flip_first_byte(chunk) if target == tampered and chunk.HasField("bucket")
            and chunk.bucket.index == 1 else chunk)
        out = transport.send(before + 1, iter(state.items()))
    finally:
        second.stop(0)
    assert isinstance(out[good], WeightAck) and out[good].version == before + 1
    assert out[good].num_tensors == len(state)
    buckets = list(GrpcStreamTransport([good], bucket_bytes=256 << 10).buckets(before + 1, iter(state.items())))
    assert len(buckets) > 2 and out[good].checksum == combine_checksums([c.bucket.checksum for c, _ in buckets])
    assert isinstance(out[tampered], TargetFailure) and out[tampered].code == "DATA_LOSS"
    assert "checksum" in out[tampered].message
    assert isinstance(out[dead], TargetFailure) and out[dead].code == "UNAVAILABLE"
    assert [e[0] for e in events if e[3]] == [good]  # done only for the target that acked
    assert _version(rollout_stub) == before + 1
    # The replica now serves the tiny model's own weights (whatever earlier tests pushed).
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    assert rollout_greedy(rollout_stub, PROMPTS[:2]) == hf_greedy_all(model, PROMPTS[:2])


def test_corrupted_push_applies_nothing(rollout_server, rollout_stub, tiny_model_dir):
    state = load_hf_state(tiny_model_dir)
    state["model.norm.weight"] = state["model.norm.weight"] * 0  # would change every generation if applied
    before = _version(rollout_stub)
    tokens_before = rollout_greedy(rollout_stub, PROMPTS)
    address = rollout_server[0].address
    transport = GrpcStreamTransport([address], bucket_bytes=1 << 20, timeout_s=60,
                                    tamper=lambda _t, c: _flip_first_byte(c) if c.HasField("bucket") else c)
    out = transport.send(before + 1, iter(state.items()))[address]
    assert isinstance(out, TargetFailure) and out.code == "DATA_LOSS"
    assert _version(rollout_stub) == before
    assert rollout_greedy(rollout_stub, PROMPTS) == tokens_before


def _swap(data: bytes, a: int, b: int, n: int) -> bytes:
    """`data` with its n-byte runs at offsets a < b exchanged."""
    return data[:a] + data[b:b + n] + data[a + n:b] + data[a:a + n] + data[b + n:]


@pytest.mark.parametrize("what", ["words", "chunks"])
def test_swapped_words_or_chunks_inside_one_tensor_are_data_loss(rollout_server, rollout_stub, tiny_model_dir, what):
    """Every byte arrives, in the wrong place: two 8-byte words, or the two halves of the tensor (two chunks
    written at each other's offsets). A sum of the words would not see it; the position-dependent one does."""
    state = load_hf_state(tiny_model_dir)
    name = next(n for n, t in state.items() if t.dim() == 2 and t.numel() * t.element_size() >= 4096)
    before = _version(rollout_stub)
    address = rollout_server[0].address

    def swap(_target, chunk):
        if not chunk.HasField("bucket") or name not in [t.name for t in chunk.bucket.tensors]:
            return chunk
        bad = rollout_pb2.WeightUpdateChunk()
        bad.CopyFrom(chunk)
        tensor = next(t for t in bad.bucket.tensors if t.name == name).tensor
        data = tensor.data
        half = len(data) // 2 // 8 * 8
        other = next(at for at in range(half + 8, len(data) - 7, 8) if data[at:at + 8] != data[half:half + 8])
        tensor.data = _swap(data, half, other, 8) if what == "words" else _swap(data, 0, half, half)
        assert tensor.data != data and sorted(tensor.data) == sorted(data)  # the same bytes, moved
        return bad

    transport = GrpcStreamTransport([address], bucket_bytes=1 << 20, timeout_s=60, tamper=swap)
    out = transport.send(before + 1, iter(state.items()))[address]
    assert isinstance(out, TargetFailure) and out.code == "DATA_LOSS", out
    assert "checksum" in out.message
    assert _version(rollout_stub) == before


def test_silent_target_times_out():
    with socket.socket() as s:  # accepts TCP connections but never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        target = f"127.0.0.1:{s.getsockname()[1]}"
        out = GrpcStreamTransport([target], timeout_s=1.5).send(1, iter([("x", torch.zeros(4))]))
    assert isinstance(out[target], TargetFailure) and out[target].code == "DEADLINE_EXCEEDED"


def test_refuses_bad_targets():
    with pytest.raises(ValueError, match="empty"):
        GrpcStreamTransport([])
    with pytest.raises(ValueError, match="duplicates"):
        GrpcStreamTransport(["a:1", "a:1"])


def _assert_unchanged(engine, stub, version: int, params: dict, tokens: list) -> None:
    """The replica serves exactly what it served before the failed push: version, every parameter bitwise,
    and the same greedy generations."""
    assert engine.unavailable_reason() is None
    assert _version(stub) == version
    now = engine_parameters(engine)
    assert now.keys() == params.keys()
    assert [n for n in params if not torch.equal(now[n], params[n])] == []
    assert rollout_greedy(stub, PROMPTS) == tokens


def _other_weights(model_dir, delta: float) -> dict[str, torch.Tensor]:
    """The model's weights, every one changed (each test its own `delta`, so no test pushes what an earlier one
    may have left applied): applied, any of them would show in the parameters."""
    return {name: t + delta for name, t in load_hf_state(model_dir).items()}


def test_push_refused_in_a_late_bucket_leaves_the_served_weights_bitwise(rollout_engine, rollout_server,
                                                                        rollout_stub, tiny_model_dir):
    state = _other_weights(tiny_model_dir, 0.01)
    before, params, tokens = _version(rollout_stub), engine_parameters(rollout_engine), rollout_greedy(rollout_stub,
                                                                                                        PROMPTS)
    address = rollout_server[0].address
    n = len(list(GrpcStreamTransport([address], bucket_bytes=256 << 10).buckets(before + 1, iter(state.items()))))
    assert n > 4
    applied = []

    def tamper(_target, chunk):
        if chunk.HasField("bucket") and chunk.bucket.index == n - 2:
            deadline = time.monotonic() + 30
            while not applied and time.monotonic() < deadline:  # earlier buckets reach the engine first
                if "did not complete" in (rollout_engine.unavailable_reason() or ""):
                    applied.append(chunk.bucket.index)
                time.sleep(0.01)
            return _flip_first_byte(chunk)
        return chunk

    transport = GrpcStreamTransport([address], bucket_bytes=256 << 10, timeout_s=60, max_queued_buckets=1,
                                    tamper=tamper)
    out = transport.send(before + 1, iter(state.items()))[address]
    assert isinstance(out, TargetFailure) and out.code == "DATA_LOSS", out
    assert applied  # the replica had applied buckets of the push before the bad one
    _assert_unchanged(rollout_engine, rollout_stub, before, params, tokens)


@pytest.mark.parametrize("end", ["cancel", "no_commit"])
def test_push_cut_after_some_buckets_leaves_the_served_weights_bitwise(rollout_engine, rollout_server, rollout_stub,
                                                                      tiny_model_dir, end):
    import threading

    from services.common.client import make_channel
    from services.common.transports.wire import serialize

    state = _other_weights(tiny_model_dir, 0.02 if end == "cancel" else 0.03)
    before, params, tokens = _version(rollout_stub), engine_parameters(rollout_engine), rollout_greedy(rollout_stub,
                                                                                                        PROMPTS)
    address = rollout_server[0].address
    buckets = [serialize(c) for c, _ in GrpcStreamTransport([address], bucket_bytes=256 << 10).buckets(
        before + 1, iter(state.items()))]
    release = threading.Event()

    def requests():
        yield from buckets[:4]  # no commit
        if end == "cancel":
            release.wait(30)

    with make_channel(address) as channel:
        update = channel.stream_unary("/rlfabric.v1.Rollout/UpdateWeights", request_serializer=lambda b: b,
                                      response_deserializer=rollout_pb2.WeightUpdateAck.FromString)
        call = update.future(requests(), timeout=60)
        if end == "cancel":
            deadline = time.monotonic() + 30
            while "did not complete" not in (rollout_engine.unavailable_reason() or ""):  # buckets were applied
                assert time.monotonic() < deadline and not call.done()
                time.sleep(0.01)
            call.cancel()
            release.set()
            while rollout_engine.unavailable_reason() is not None:  # the replica restores after the cancel
                assert time.monotonic() < deadline
                time.sleep(0.01)
        else:
            with pytest.raises(grpc.RpcError) as e:
                call.result()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "WeightCommit" in e.value.details()
    _assert_unchanged(rollout_engine, rollout_stub, before, params, tokens)
