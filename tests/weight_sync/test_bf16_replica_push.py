"""A bf16 DeepSeek-V3 replica gets the trainer's expert bias unrounded (issue 24): vLLM keeps
`e_score_correction_bias` in float32 whatever the model dtype, Rollout.Info lists that dtype for it (the dtype of the
vLLM parameter each HF tensor loads into, not the model dtype for all), the plan sends it in float32 while the rest
goes in bf16, and after a push the replica holds the trainer's float32 bias bit for bit and the bf16 cast of every
other tensor. The trainer (float32, seed 1's weights) pushes to a bf16 engine serving seed 0's, over gRPC and shared
memory (where the replica copies each tensor straight into its parameter).

Slow: a bf16 vLLM DeepSeek engine of its own (about 40 s to build on CPU) and a trainer group.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from weight_sync_helpers import rollout_version, serve_rollout

from rlfabric.v1 import common_pb2, rollout_pb2, trainer_pb2
from services.coordinator.resharding import plan_resharding

pytestmark = pytest.mark.slow

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # layer 0 is dense, layer 1 the MoE layer
TRANSPORTS = {"grpc": trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM, "shm": trainer_pb2.WEIGHT_TRANSPORT_SHM}


@pytest.fixture(scope="module")
def bf16_replica(deepseek_dirs, tmp_path_factory) -> Iterator[tuple]:
    """(engine, server): a bf16 DeepSeek engine serving seed 0's weights."""
    pytest.importorskip("vllm")
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    engine = RolloutEngine(EngineOptions(
        model=str(deepseek_dirs[0]), dtype="bfloat16", tensor_parallel_size=1, max_model_len=256, max_num_seqs=16,
        num_threads=1, cpu_kv_cache_gib=1, cache_root=str(tmp_path_factory.mktemp("vllm_deepseek_bf16_cache"))))
    server = serve_rollout(engine)
    yield engine, server
    server.stop(0)
    engine.close()


@pytest.fixture(scope="module")
def fp32_trainer(start_trainer, deepseek_dirs) -> Iterator:
    """A Trainer stub of a one-rank group holding seed 1's weights in float32."""
    from rlfabric.v1 import trainer_pb2_grpc

    group, address = start_trainer("--hf-dir", str(deepseek_dirs[1]), "--forward-micro-batch-size", "4")
    channel = grpc.insecure_channel(address)
    yield trainer_pb2_grpc.TrainerStub(channel)
    channel.close()
    group.stop(grace_s=12)


def _replica_parameters(address: str) -> list:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    with make_channel(address) as channel:
        return list(rollout_pb2_grpc.RolloutStub(channel).Info(
            rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters)


def test_the_replica_lists_the_bias_in_float32_and_the_rest_in_bf16(bf16_replica) -> None:
    _, server = bf16_replica
    dtypes = {p.name: p.dtype for p in _replica_parameters(server.address)}
    assert dtypes.pop(BIAS) == common_pb2.DTYPE_FLOAT32
    assert set(dtypes.values()) == {common_pb2.DTYPE_BFLOAT16}


def test_a_push_gives_the_bf16_replica_the_trainers_float32_bias_bitwise(fp32_trainer, bf16_replica,
                                                                         deepseek_dirs) -> None:
    from services.common.transports import GrpcStreamTransport, WeightAck
    from services.trainer.convert import load_hf_state

    engine, server = bf16_replica
    seed0, seed1 = load_hf_state(Path(deepseek_dirs[0])), load_hf_state(Path(deepseek_dirs[1]))
    assert seed1[BIAS].dtype == torch.float32 and not torch.equal(seed1[BIAS].to(torch.bfloat16).float(), seed1[BIAS])
    shards = fp32_trainer.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards
    plan = plan_resharding(shards, _replica_parameters(server.address),
                           json.loads((deepseek_dirs[0] / "config.json").read_text()))
    assert plan.dtype == "bfloat16" and dict(plan.tensor_dtypes) == {BIAS: "float32"}
    for name, transport in TRANSPORTS.items():
        held = engine.read_weights([BIAS])[BIAS]
        assert held.dtype == torch.float32 and not torch.equal(held, seed1[BIAS]), name  # the push has work to do
        version = rollout_version(server.address) + 1
        progress = list(fp32_trainer.PushWeights(trainer_pb2.PushWeightsRequest(
            version=version, targets=[server.address], plan=plan.to_proto(), transport=transport,
            bucket_bytes=256 << 10), timeout=120))
        (done,) = [p for p in progress if p.done]
        # The bias travels in float32 (4 bytes per value), the rest in bf16 (2).
        assert done.bytes_sent == done.bytes_total == 2 * sum(t.numel() for t in seed1.values()) + 2 * seed1[BIAS].numel()
        assert engine.weights_version == version, name
        held = engine.read_weights(list(seed1))
        assert held[BIAS].dtype == torch.float32 and torch.equal(held[BIAS], seed1[BIAS]), name
        differing = [n for n, t in seed1.items() if n != BIAS and not torch.equal(held[n], t.to(torch.bfloat16))]
        assert not differing, (name, differing[:3])
        # Back to seed 0 (the replica's own values, as vLLM loaded them) before the next transport.
        restore = {n: t if n == BIAS else t.to(torch.bfloat16) for n, t in seed0.items()}
        outcome = GrpcStreamTransport([server.address], timeout_s=120).send(version + 1, iter(restore.items()))
        assert isinstance(outcome[server.address], WeightAck), outcome
