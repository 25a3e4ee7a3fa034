"""Info, Sleep/Wake, admission bound and metrics of the rollout service."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from rollout_helpers import generate, group_request, prompts, tokens

from rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.client import make_channel


def test_info_describes_the_engine(rollout_stub, rollout_engine, tiny_model_dir) -> None:
    info = rollout_stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30)
    assert info.model == str(tiny_model_dir)
    assert info.engine.startswith("vllm ")
    assert info.tensor_parallel_size == 1
    assert info.dtype == common_pb2.DTYPE_FLOAT32
    assert info.max_model_len == 256  # tests/conftest.py builds the engine with it
    assert info.max_samples_per_group == 4 * 32  # 4 x max_num_seqs
    assert not info.sleeping
    brief = rollout_stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30)
    assert len(brief.parameters) == 0


def test_info_lists_parameters_under_the_names_update_weights_takes(rollout_stub, rollout_engine) -> None:
    params = {p.name: (list(p.shape), p.dtype) for p in rollout_stub.Info(
        rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters}
    # HF checkpoint names and full shapes (4 query heads and 2 kv heads of 32, hidden 128), never vLLM's fused
    # qkv_proj / gate_up_proj, which UpdateWeights refuses.
    assert params["model.layers.0.self_attn.q_proj.weight"] == ([128, 128], common_pb2.DTYPE_FLOAT32)
    assert params["model.layers.0.self_attn.k_proj.weight"] == ([64, 128], common_pb2.DTYPE_FLOAT32)
    assert params["model.layers.1.mlp.gate_proj.weight"] == ([512, 128], common_pb2.DTYPE_FLOAT32)
    assert params["model.embed_tokens.weight"] == ([4096, 128], common_pb2.DTYPE_FLOAT32)
    assert not [n for n in params if "qkv_proj" in n or "gate_up_proj" in n]
    assert set(params) == set(rollout_engine.expected_weights)  # exactly what the stager accepts


def test_sleep_releases_the_kv_cache_and_wake_restores_generation(rollout_stub, rollout_engine) -> None:
    prompt = prompts(1, seed=9)[0]
    before = tokens(generate(rollout_stub, [group_request("w", prompt, temperature=0.0, max_tokens=10)])[0])
    slept = rollout_stub.Sleep(rollout_pb2.SleepRequest(level=1), timeout=60)
    try:
        assert slept.duration_s > 0
        assert rollout_stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).sleeping
        if rollout_engine.is_cpu:
            assert rollout_engine._kv_released_bytes > 0
        again = rollout_stub.Sleep(rollout_pb2.SleepRequest(level=1), timeout=60)  # idempotent
        assert again.duration_s == 0
        with pytest.raises(grpc.RpcError) as err:
            generate(rollout_stub, [group_request("asleep", prompt, temperature=0.0)])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Wake" in err.value.details()
    finally:
        woke = rollout_stub.Wake(rollout_pb2.WakeRequest(), timeout=60)
    assert woke.duration_s > 0
    assert not rollout_stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).sleeping
    after = tokens(generate(rollout_stub, [group_request("w", prompt, temperature=0.0, max_tokens=10)])[0])
    assert after == before


def test_sleep_level_is_checked(rollout_stub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        rollout_stub.Sleep(rollout_pb2.SleepRequest(level=3), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_admission_never_exceeds_its_bound(rollout_engine) -> None:
    # A second server on the same engine, with a small bound: 12 groups of 2 samples, at most 4 inside.
    from services.rollout.options import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, servicer = create_rollout_server(rollout_engine, SamplingOptions(max_tokens=8),
                                             max_in_flight_samples=4, metrics_port=None)
    server.start()
    try:
        with make_channel(server.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            requests = [group_request(f"g{i}", p, n=2, temperature=1.0, seed=i)
                        for i, p in enumerate(prompts(12, seed=4))]
            samples = generate(stub, requests)
    finally:
        server.stop(0)
    assert len(samples) == 24
    assert servicer.admission.peak == 4
    assert servicer.admission.used == 0


def test_metrics_report_tokens_version_and_latency(rollout_stub, rollout_server) -> None:
    server, _ = rollout_server
    generate(rollout_stub, [group_request("m", [5, 6, 7], temperature=0.0, max_tokens=4)])
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.MULTILINE)
        assert match, f"{name} missing from /metrics"
        return float(match.group(1))

    assert value("rlfabric_rollout_generated_tokens_total") >= 4
    assert value("rlfabric_rollout_time_to_first_token_seconds_count") >= 1
    assert value("rlfabric_rollout_weights_version") >= 0
    assert 'rlfabric_rollout_requests{state="running"}' in body
    assert "rlfabric_rollout_weight_update_seconds_bucket" in body
