"""PushWeights from an expert-parallel trainer: a real trainer group at EP 2 (two gloo ranks, each holding half of
a tiny Qwen3-MoE's experts) pushes to a real vLLM MoE replica over every transport; the replica then holds the
trainer's weights bit for bit (per-expert HF tensors assembled from both EP ranks) and greedy equals transformers.

The trainer starts from one checkpoint (seed 1) and the replica from another (seed 0, same names), so each push
changes every tensor the replica holds; the replica is put back to seed 0 before the next transport.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
import torch
from weight_sync_helpers import (
    assert_engine_reads_back,
    hf_checkpoint,
    names_by_expert_rank,
    restore_checkpoint_weights,
    rollout_greedy,
    rollout_version,
    serve_rollout,
    start_ep2_trainer,
)

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.coordinator.resharding import plan_resharding

TRANSPORTS = {"grpc": trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM, "shm": trainer_pb2.WEIGHT_TRANSPORT_SHM,
              "collective": trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE}
PROMPTS = [[5, 99, 1200, 7, 3000, 42], [17, 18, 19, 20], [4000, 3, 3, 812, 90, 91, 92, 2048]]


@pytest.fixture(scope="module")
def moe_replica(moe_engine) -> Iterator[tuple]:
    """(engine, server): the session's MoE engine (seed 0, tests/conftest.py) behind a server of this module."""
    server = serve_rollout(moe_engine)
    yield moe_engine, server
    server.stop(0)


@pytest.fixture(scope="module")
def ep2_trainer(start_trainer, moe_dirs) -> Iterator:
    """A Trainer stub of an EP 2 group holding seed 1's weights."""
    group, stub = start_ep2_trainer(start_trainer, moe_dirs[1])
    yield stub
    group.stop(grace_s=12)




def test_ep2_trainer_reports_each_expert_rank_once(ep2_trainer) -> None:
    info = ep2_trainer.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60)
    assert (info.tensor_parallel_size, info.pipeline_parallel_size, info.data_parallel_size) == (1, 1, 2)
    by_rank = names_by_expert_rank(info)
    assert set(by_rank) == {0, 1}
    for names in by_rank.values():
        experts = {n.split(".local_experts.")[1].split(".")[0] for n in names if ".local_experts." in n}
        assert experts == {"0", "1", "2", "3"}  # 8 experts over EP 2, numbered on their rank
        assert "decoder.layers.1.mlp.router.weight" in names  # the shared weights: on every EP rank
    assert sorted(by_rank[0]) == sorted(by_rank[1])


def test_ep2_push_lands_bitwise_over_every_transport(ep2_trainer, moe_replica, moe_dirs) -> None:
    import transformers
    from weight_sync_helpers import hf_greedy_all

    engine, server = moe_replica
    address = server.address
    seed0, seed1 = hf_checkpoint(moe_dirs[0]), hf_checkpoint(moe_dirs[1])
    hf0 = transformers.AutoModelForCausalLM.from_pretrained(str(moe_dirs[0]), dtype=torch.float32).eval()
    hf1 = transformers.AutoModelForCausalLM.from_pretrained(str(moe_dirs[1]), dtype=torch.float32).eval()
    greedy0, greedy1 = hf_greedy_all(hf0, PROMPTS), hf_greedy_all(hf1, PROMPTS)
    assert greedy0 != greedy1  # the push is visible in what the replica generates

    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    hf_config = json.loads((moe_dirs[0] / "config.json").read_text())
    with make_channel(address) as channel:
        rollout = rollout_pb2_grpc.RolloutStub(channel)
        params = rollout.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters
        shards = ep2_trainer.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards
        plan = plan_resharding(shards, params, hf_config)
        assert plan.trainer_ep == 2 and len(plan.tensors) == len(seed1)
        assert {s.ep_rank for r in plan.tensors for s in r.sources} == {0, 1}
        try:
            for name, transport in TRANSPORTS.items():
                assert rollout_greedy(rollout, PROMPTS) == greedy0, name  # seed 0 before the push
                version = rollout_version(address) + 1
                progress = list(ep2_trainer.PushWeights(trainer_pb2.PushWeightsRequest(
                    version=version, targets=[address], plan=plan.to_proto(), transport=transport,
                    bucket_bytes=256 << 10), timeout=120))
                done = [p for p in progress if p.done]
                assert len(done) == 1 and done[0].bytes_sent == done[0].bytes_total > 0, name
                assert engine.weights_version == version, name
                assert_engine_reads_back(engine, seed1)  # every per-expert tensor, from both EP ranks, bit for bit
                assert rollout_greedy(rollout, PROMPTS, version=version) == greedy1, name
                restore_checkpoint_weights(address, moe_dirs[0])
                assert_engine_reads_back(engine, seed0)
        finally:
            restore_checkpoint_weights(address, moe_dirs[0])


def test_a_plan_for_another_expert_layout_is_refused(ep2_trainer, moe_replica, moe_dirs) -> None:
    from services.common import weight_layout
    from services.common.model_spec import read_hf_config
    from services.common.reshard_plan import ReshardPlan

    _, server = moe_replica
    spec, _ = read_hf_config(moe_dirs[0])
    ep1 = ReshardPlan(1, 1, tuple(weight_layout.recipes(spec, 1, 1, 1)), "float32", 1)
    with pytest.raises(grpc.RpcError) as e:
        list(ep2_trainer.PushWeights(trainer_pb2.PushWeightsRequest(
            version=rollout_version(server.address) + 1, targets=[server.address], plan=ep1.to_proto()), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "EP=1" in e.value.details()
