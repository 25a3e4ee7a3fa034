"""The gRPC stream transport against real rollout servers: several targets, corruption, dead and silent targets."""

from __future__ import annotations

import socket

import pytest
import torch
import transformers
from weight_sync_helpers import PROMPTS, hf_greedy_all, rollout_greedy, serve_rollout

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
