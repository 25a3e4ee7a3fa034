"""PushWeights from an expert-parallel trainer holding the tiny DeepSeek-V3: a real trainer group at EP 2 (two gloo
ranks, each holding 4 of the 8 routed experts; multi-latent attention with q / kv LoRA ranks, the shared expert, the
dense first layer and the routers' expert bias on both) pushes, through the resharding plan, to a real vLLM
DeepSeek replica (which fuses q_a / kv_a into `fused_qkv_a_proj` and the experts into `w13` / `w2`) over every
transport; the replica then holds the trainer's weights bit for bit (per-expert HF tensors assembled from both EP
ranks) and greedy equals transformers' with those weights, as it did with the replica's own weights before.

The trainer starts from one checkpoint (seed 1, its expert bias drawn too) and the replica from another (seed 0),
so each push changes every tensor the replica holds; the replica is put back to seed 0 before the next transport.
Slow: the session's DeepSeek engine (tests/conftest.py deepseek_engine, about two minutes to build on CPU).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from weight_sync_helpers import (
    PROMPTS,
    assert_engine_reads_back,
    hf_checkpoint,
    hf_greedy_all,
    names_by_expert_rank,
    restore_checkpoint_weights,
    rollout_greedy,
    rollout_version,
    serve_rollout,
    start_ep2_trainer,
)

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.coordinator.resharding import plan_resharding

pytestmark = pytest.mark.slow

TRANSPORTS = {"grpc": trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM, "shm": trainer_pb2.WEIGHT_TRANSPORT_SHM,
              "collective": trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE}
MOE = "decoder.layers.1.mlp."  # layer 0 is dense, layer 1 the MoE layer
MLA = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
       "kv_layernorm.weight", "linear_kv_up_proj.weight", "linear_proj.weight")


@pytest.fixture(scope="module")
def deepseek_replica(deepseek_engine) -> Iterator[tuple]:
    """(engine, server): the session's DeepSeek engine (seed 0) behind a server of this module."""
    server = serve_rollout(deepseek_engine)
    yield deepseek_engine, server
    server.stop(0)


@pytest.fixture(scope="module")
def ep2_trainer(start_trainer, deepseek_dirs) -> Iterator:
    """A Trainer stub of an EP 2 group holding seed 1's weights."""
    group, stub = start_ep2_trainer(start_trainer, deepseek_dirs[1])
    yield stub
    group.stop(grace_s=12)


@pytest.fixture(scope="module")
def plan(ep2_trainer, deepseek_replica, deepseek_dirs):
    """The coordinator's plan from what the two services report (Info with parameters), as a push computes it."""
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    _, server = deepseek_replica
    with make_channel(server.address) as channel:
        params = rollout_pb2_grpc.RolloutStub(channel).Info(
            rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters
    shards = ep2_trainer.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards
    return plan_resharding(shards, params, json.loads((deepseek_dirs[0] / "config.json").read_text()))




def test_ep2_trainer_reports_the_deepseek_layout(ep2_trainer) -> None:
    info = ep2_trainer.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60)
    assert (info.tensor_parallel_size, info.pipeline_parallel_size, info.data_parallel_size) == (1, 1, 2)
    by_rank = names_by_expert_rank(info)
    assert set(by_rank) == {0, 1}
    for names in by_rank.values():
        experts = {n.split(".local_experts.")[1].split(".")[0] for n in names if ".local_experts." in n}
        assert experts == {"0", "1", "2", "3"}  # 8 routed experts over EP 2, numbered on their rank
        for layer in (0, 1):  # MLA in the dense layer and in the MoE layer
            assert {f"decoder.layers.{layer}.self_attention.{m}" for m in MLA} <= set(names)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in names and "decoder.layers.0.mlp.router.weight" not in names
        assert {MOE + "router.weight", MOE + "router.expert_bias", MOE + "shared_experts.linear_fc1.weight",
                MOE + "shared_experts.linear_fc2.weight"} <= set(names)  # on every EP rank
    assert sorted(by_rank[0]) == sorted(by_rank[1])


def test_the_plan_composes_every_replica_tensor_from_both_expert_ranks(plan, deepseek_dirs) -> None:
    seed1 = hf_checkpoint(deepseek_dirs[1])
    assert plan.trainer_ep == 2 and plan.dtype == "float32"
    by_name = {r.hf_name: r for r in plan.tensors}
    assert set(by_name) == set(seed1) and len(plan.tensors) == len(seed1)
    assert {s.ep_rank for r in plan.tensors for s in r.sources} == {0, 1}

    def source(hf_name: str) -> tuple[str, int]:
        (s,) = by_name[hf_name].sources
        return s.name, s.ep_rank

    layer = "model.layers.1.mlp."
    assert source(layer + "experts.5.down_proj.weight") == (MOE + "experts.local_experts.1.linear_fc2.weight", 1)
    assert source(layer + "experts.2.up_proj.weight") == (MOE + "experts.local_experts.2.linear_fc1.weight", 0)
    assert source(layer + "gate.e_score_correction_bias") == (MOE + "router.expert_bias", 0)
    assert source(layer + "shared_experts.down_proj.weight") == (MOE + "shared_experts.linear_fc2.weight", 0)
    assert source("model.layers.0.self_attn.kv_a_layernorm.weight") == (
        "decoder.layers.0.self_attention.kv_layernorm.weight", 0)
    assert source("model.layers.1.self_attn.q_a_proj.weight") == (
        "decoder.layers.1.self_attention.linear_q_down_proj.weight", 0)
    assert source("model.layers.0.mlp.down_proj.weight") == ("decoder.layers.0.mlp.linear_fc2.weight", 0)


def test_ep2_push_lands_bitwise_over_every_transport(ep2_trainer, deepseek_replica, deepseek_dirs, plan) -> None:
    import transformers

    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    engine, server = deepseek_replica
    address = server.address
    seed0, seed1 = hf_checkpoint(deepseek_dirs[0]), hf_checkpoint(deepseek_dirs[1])
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(seed0[bias], seed1[bias])  # the bias is pushed, not only kept
    hf0 = transformers.AutoModelForCausalLM.from_pretrained(str(deepseek_dirs[0]), dtype=torch.float32).eval()
    hf1 = transformers.AutoModelForCausalLM.from_pretrained(str(deepseek_dirs[1]), dtype=torch.float32).eval()
    greedy0, greedy1 = hf_greedy_all(hf0, PROMPTS), hf_greedy_all(hf1, PROMPTS)
    assert greedy0 != greedy1  # the push is visible in what the replica generates
    with make_channel(address) as channel:
        rollout = rollout_pb2_grpc.RolloutStub(channel)
        try:
            for name, transport in TRANSPORTS.items():
                assert_engine_reads_back(engine, seed0)
                assert rollout_greedy(rollout, PROMPTS, version=engine.weights_version) == greedy0, name
                version = rollout_version(address) + 1
                progress = list(ep2_trainer.PushWeights(trainer_pb2.PushWeightsRequest(
                    version=version, targets=[address], plan=plan.to_proto(), transport=transport,
                    bucket_bytes=256 << 10), timeout=120))
                done = [p for p in progress if p.done]
                assert len(done) == 1 and done[0].bytes_sent == done[0].bytes_total > 0, name
                assert engine.weights_version == version, name
                assert_engine_reads_back(engine, seed1)  # every tensor, each expert's from its EP rank, bit for bit
                assert rollout_greedy(rollout, PROMPTS, version=version) == greedy1, name
                restore_checkpoint_weights(address, deepseek_dirs[0])
        finally:
            restore_checkpoint_weights(address, deepseek_dirs[0])
    assert_engine_reads_back(engine, seed0)
