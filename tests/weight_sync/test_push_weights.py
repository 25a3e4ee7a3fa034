"""PushWeights end to end: a real trainer group (TP 1; TP 2 and PP 2 as two gloo processes) pushes to a real rollout."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import torch
from weight_sync_helpers import PROMPTS, hf_greedy_all, rollout_greedy

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.common.checksum import combine_checksums
from services.common.sequences import Sequences
from services.common.tensors import to_proto
from services.common.transports.grpc_stream import GrpcStreamTransport
from services.coordinator.resharding import ReshardPlan, plan_resharding

BUCKET_BYTES = 512 << 10  # several buckets for the tiny model


def _update(stub, version: int) -> int:
    rng = np.random.default_rng(version)
    n = 4
    seqs = Sequences.from_lists([f"u{version}-{i}" for i in range(n)], [rng.integers(3, 4096, 6) for _ in range(n)],
                                [rng.integers(3, 4096, 5) for _ in range(n)], version)
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), advantages=to_proto(np.array([1, -1, 0.5, -0.5], np.float32)),
                                    temperature=1.0, step=version + 1)
    return stub.Update(iter([req]), timeout=120).weights_version


def _explicit_plan(trainer_stub, rollout_stub, hf_config: dict | None = None, model_dir=None) -> bytes:
    """What a coordinator sends: the plan from both services' Info."""
    if hf_config is None:
        hf_config = json.loads((model_dir / "config.json").read_text())
    shards = trainer_stub.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=30).shards
    params = rollout_stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=30).parameters
    return plan_resharding(shards, params, hf_config).to_json()


def _converted_weights(trainer_stub, work, tiny_model_dir):
    """The trainer's current weights as an HF folder, via SaveCheckpoint and `convert_mcore_to_hf`."""
    from services.trainer.convert import convert_mcore_to_hf

    ckpt = work / "ckpt"
    trainer_stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(ckpt), iteration=1), timeout=120)
    return convert_mcore_to_hf(ckpt, work / "hf", hf_assets=tiny_model_dir)


def test_push_after_update_delivers_the_trainers_weights_bitwise(trainer, rollout_stub, tiny_model_dir):
    import transformers

    from services.trainer.convert import load_hf_state

    stub = trainer["stub"]
    version = _update(stub, 0)
    assert version == 1
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    plan = _explicit_plan(stub, rollout_stub, hf_config)
    address = trainer["rollout_address"]
    progress = list(stub.PushWeights(trainer_pb2.PushWeightsRequest(
        version=version, targets=[address], bucket_bytes=BUCKET_BYTES, plan=plan), timeout=120))
    done = [p for p in progress if p.done]
    assert len(done) == 1 and done[0].target == address
    assert done[0].bytes_sent == done[0].bytes_total > 0
    sent = [p.bytes_sent for p in progress if not p.done]
    assert len(sent) > 1 and sent == sorted(sent)
    assert rollout_stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version == 1

    # Bitwise: the acked checksum equals the checksum of the trainer's weights converted by mcore_to_hf.
    hf_dir = _converted_weights(stub, trainer["work"], tiny_model_dir)
    state = load_hf_state(hf_dir)
    order = [r.hf_name for r in ReshardPlan.from_json(plan).tensors]
    buckets = GrpcStreamTransport([address], bucket_bytes=BUCKET_BYTES).buckets(version, ((n, state[n]) for n in order))
    assert done[0].checksum == combine_checksums([c.bucket.checksum for c, _ in buckets])
    original = load_hf_state(tiny_model_dir)
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert rollout_greedy(rollout_stub, PROMPTS, version=1) == hf_greedy_all(model, PROMPTS)

    # Version fencing: a request for another version is refused (0 means "any version", per rollout.proto).
    with pytest.raises(grpc.RpcError) as e:
        rollout_greedy(rollout_stub, PROMPTS[:1], version=2)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_failing_target_fails_the_call_naming_it(trainer, rollout_stub, tiny_model_dir):
    stub = trainer["stub"]
    plan = _explicit_plan(stub, rollout_stub, model_dir=tiny_model_dir)
    address = trainer["rollout_address"]
    version = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    dead = "127.0.0.1:9"  # discard port: nothing listens
    got: list = []
    with pytest.raises(grpc.RpcError) as e:
        for p in stub.PushWeights(trainer_pb2.PushWeightsRequest(version=version, targets=[address, dead], plan=plan),
                                  timeout=60):
            got.append(p)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dead in e.value.details() and address not in e.value.details()
    assert [p.target for p in got if p.done] == [address]  # the healthy replica applied the version
    assert rollout_stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version == version


def test_refused_pushes(trainer, rollout_stub, tiny_model_dir):
    stub = trainer["stub"]
    address = trainer["rollout_address"]
    version = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    assert version >= 1  # the tests above pushed at least once
    plan = _explicit_plan(stub, rollout_stub, model_dir=tiny_model_dir)
    cases = [
        (trainer_pb2.PushWeightsRequest(version=version - 1, targets=[address], plan=plan),
         grpc.StatusCode.FAILED_PRECONDITION, "only move forward"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address]), grpc.StatusCode.INVALID_ARGUMENT,
         "plan is empty"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[], plan=plan), grpc.StatusCode.INVALID_ARGUMENT,
         "targets"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], plan=b"{oops"),
         grpc.StatusCode.INVALID_ARGUMENT, "JSON"),
        (trainer_pb2.PushWeightsRequest(version=version, targets=[address], transport="shm", plan=plan),
         grpc.StatusCode.UNIMPLEMENTED, "shm"),
    ]
    for req, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PushWeights(req, timeout=60))
        assert e.value.code() == code and words in e.value.details(), e.value.details()
