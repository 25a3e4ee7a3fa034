"""PushWeights end to end: a real trainer group (TP 1; TP 2 and PP 2 as two gloo processes) pushes to a real rollout."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch
from weight_sync_helpers import PROMPTS, assert_engine_holds, hf_greedy_all, rollout_greedy, rollout_version

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.common.checksum import combine_checksums
from services.common.sequences import Sequences
from services.common.tensors import to_proto
from services.common.transports.grpc_stream import GrpcStreamTransport
from services.coordinator.resharding import plan_resharding

BUCKET_BYTES = 512 << 10  # several buckets for the tiny model


def _update(stub, version: int) -> int:
    rng = np.random.default_rng(version)
    n = 4
    seqs = Sequences.from_lists([f"u{version}-{i}" for i in range(n)], [rng.integers(3, 4096, 6) for _ in range(n)],
                                [rng.integers(3, 4096, 5) for _ in range(n)], version)
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), advantages=to_proto(np.array([1, -1, 0.5, -0.5], np.float32)),
                                    temperature=1.0, step=version + 1)
    return stub.Update(iter([req]), timeout=120).weights_version


def _explicit_plan(trainer_stub, rollout_stub, model_dir) -> trainer_pb2.ReshardPlan:
    """What a coordinator sends: the plan from both services' Info."""
    hf_config = json.loads((model_dir / "config.json").read_text())
    shards = trainer_stub.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=30).shards
    params = rollout_stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters
    return plan_resharding(shards, params, hf_config).to_proto()


def _next_version(trainer_stub, address: str) -> int:
    """As the coordinator numbers a push: above every version the trainer or the replica ever held."""
    return max(trainer_stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version,
               rollout_version(address)) + 1


def _converted_weights(trainer_stub, work, tiny_model_dir):
    """The trainer's current weights as an HF folder, via SaveCheckpoint and `convert_mcore_to_hf`."""
    from services.trainer.convert import convert_mcore_to_hf

    ckpt = work / "ckpt"
    trainer_stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(ckpt), iteration=1), timeout=120)
    return convert_mcore_to_hf(ckpt, work / "hf", hf_assets=tiny_model_dir)


@pytest.mark.parametrize("transport", [trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM, trainer_pb2.WEIGHT_TRANSPORT_SHM],
                         ids=["grpc", "shm"])
def test_push_after_update_delivers_the_trainers_weights_bitwise(trainer, rollout_stub, rollout_engine,
                                                                 tiny_model_dir, transport):
    import transformers

    from services.trainer.convert import load_hf_state

    stub = trainer["stub"]
    held = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    assert _update(stub, held) == held + 1
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    address = trainer["rollout_address"]
    version = _next_version(stub, address)
    progress = list(stub.PushWeights(trainer_pb2.PushWeightsRequest(
        version=version, targets=[address], bucket_bytes=BUCKET_BYTES, plan=plan, transport=transport), timeout=120))
    done = [p for p in progress if p.done]
    assert len(done) == 1 and done[0].target == address
    assert done[0].bytes_sent == done[0].bytes_total > 0
    sent = [p.bytes_sent for p in progress if not p.done]
    assert len(sent) > 1 and sent == sorted(sent)
    assert rollout_version(address) == version
    assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version == version  # adopted: all acked

    # Bitwise: the acked checksum equals the checksum of the trainer's weights converted by mcore_to_hf.
    hf_dir = _converted_weights(stub, trainer["work"], tiny_model_dir)
    state = load_hf_state(hf_dir)
    order = [t.name for t in plan.tensors]
    buckets = GrpcStreamTransport([address], bucket_bytes=BUCKET_BYTES).buckets(version, ((n, state[n]) for n in order))
    assert done[0].checksum == combine_checksums([c.bucket.checksum for c, _ in buckets])
    original = load_hf_state(tiny_model_dir)
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
    assert_engine_holds(rollout_engine, state)  # every vLLM parameter, bit for bit

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert rollout_greedy(rollout_stub, PROMPTS, version=version) == hf_greedy_all(model, PROMPTS)

    # Version fencing: a request for another version is refused (0 means "any version", per rollout.proto).
    with pytest.raises(grpc.RpcError) as e:
        rollout_greedy(rollout_stub, PROMPTS[:1], version=version + 1)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_failing_target_fails_the_call_naming_it(trainer, rollout_stub, tiny_model_dir):
    stub = trainer["stub"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    address = trainer["rollout_address"]
    held = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    version = _next_version(stub, address)
    dead = "127.0.0.1:9"  # discard port: nothing listens
    got: list = []
    with pytest.raises(grpc.RpcError) as e:
        for p in stub.PushWeights(trainer_pb2.PushWeightsRequest(version=version, targets=[address, dead], plan=plan),
                                  timeout=60):
            got.append(p)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dead in e.value.details() and address not in e.value.details()
    assert [p.target for p in got if p.done] == [address]  # the healthy replica applied the version
    assert rollout_version(address) == version
    # Not every target acked: the trainer's weights keep their old label (a push used to move it anyway).
    assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version == held


def test_refused_pushes(trainer, rollout_stub, tiny_model_dir):
    stub = trainer["stub"]
    address = trainer["rollout_address"]
    version = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    assert version >= 1  # the tests above pushed at least once
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    other_layout = trainer_pb2.ReshardPlan()
    other_layout.CopyFrom(plan)
    other_layout.trainer_tensor_parallel_size = 8
    overlapping = trainer_pb2.ReshardPlan()
    overlapping.CopyFrom(plan)
    overlapping.tensors[0].sources[0].stop = overlapping.tensors[0].sources[0].shard_shape[0] + 1
    huge = "h" * 100_000
    cases = [
        (trainer_pb2.PushWeightsRequest(version=version - 1, targets=[address], plan=plan),
         grpc.StatusCode.FAILED_PRECONDITION, "only move forward"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address]), grpc.StatusCode.INVALID_ARGUMENT,
         "plan is missing"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[], plan=plan), grpc.StatusCode.INVALID_ARGUMENT,
         "targets"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], plan=trainer_pb2.ReshardPlan()),
         grpc.StatusCode.INVALID_ARGUMENT, "trainer sizes"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], plan=other_layout),
         grpc.StatusCode.INVALID_ARGUMENT, "TP=8"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], plan=overlapping),
         grpc.StatusCode.INVALID_ARGUMENT, "inside a block"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], transport=7, plan=plan),
         grpc.StatusCode.INVALID_ARGUMENT, "WEIGHT_TRANSPORT_GRPC_STREAM"),
        # A 100 kB client value echoed whole used to turn the code into RESOURCE_EXHAUSTED at the client.
        (trainer_pb2.PushWeightsRequest(version=version, targets=[huge, huge], plan=plan),
         grpc.StatusCode.INVALID_ARGUMENT, "duplicates"),
    ]
    for req, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PushWeights(req, timeout=60))
        assert e.value.code() == code and words in e.value.details(), e.value.details()
        assert len(e.value.details()) < 1000


def test_coordinator_picks_shm_on_the_same_host_and_falls_back_to_grpc(trainer, rollout_stub, rollout_engine,
                                                                       tiny_model_dir, monkeypatch):
    from services.common.transports.shm import SegmentOpenError
    from services.coordinator.weight_sync import GRPC, SHM, Replica, WeightSync
    from services.rollout import weights

    if (trainer["tp"], trainer["pp"]) != (1, 1):
        pytest.skip("the choice of transport does not depend on the trainer layout")
    stub, address = trainer["stub"], trainer["rollout_address"]
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    sync = WeightSync(stub, [Replica(address, rollout_stub)], hf_config, 120, actor_address=trainer["address"])
    assert sync.transports == {address: SHM}  # both on 127.0.0.1
    assert WeightSync(stub, [Replica(address, rollout_stub)], hf_config, 120).transports == {address: GRPC}
    version = _next_version(stub, address)
    sync.push(version)
    assert sync.version == version == rollout_engine.weights_version

    class Unmappable:
        def array(self, ref):
            raise SegmentOpenError(f"cannot open shared-memory segment {ref.path}: no such file (test)")

    monkeypatch.setattr(weights, "SEGMENTS", Unmappable())
    sync.push(version + 1)  # the shm push fails, the same version goes over gRPC
    assert sync.version == version + 1 == rollout_engine.weights_version
    assert sync.transports == {address: GRPC}
    assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version == version + 1
