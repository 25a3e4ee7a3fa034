"""Rollout fixtures: ONE vLLM engine and ONE server per test session (building the engine is the slow part).

Tests that change the engine's state (weights, sleep) must put it back before they return, so that every
test can assume the weights of `tiny_model_dir` at some version and an awake engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from rollout_helpers import MAX_MODEL_LEN, MAX_NUM_SEQS


@pytest.fixture(scope="session")
def rollout_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("vllm")
    from services.rollout.engine import EngineOptions, RolloutEngine

    engine = RolloutEngine(EngineOptions(
        model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
        num_threads=1, cpu_kv_cache_gib=1, cache_root=str(tmp_path_factory.mktemp("vllm_cache")),
    ))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def rollout_server(rollout_engine) -> Iterator:
    from services.rollout.engine import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, servicer = create_rollout_server(rollout_engine, SamplingOptions(max_tokens=16, temperature=1.0),
                                             metrics_port=0)
    server.start()
    yield server, servicer
    server.stop(0)


@pytest.fixture()
def rollout_stub(rollout_server) -> Iterator:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    server, _ = rollout_server
    channel: grpc.Channel = make_channel(server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.eval()
    return model
