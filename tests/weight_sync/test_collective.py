"""The collective weight transport end to end: a real trainer group (TP 1) broadcasts over gloo to the session's
real vLLM replica, directly (PushWeights) and as the coordinator drives it (WeightSync)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_push_weights import BUCKET_BYTES, _converted_weights, _explicit_plan, _next_version, _update
from weight_sync_helpers import assert_engine_holds, restore_checkpoint_weights, rollout_version

from rlfabric.v1 import trainer_pb2
from services.common.checksum import combine_checksums
from services.common.transports.grpc_stream import GrpcStreamTransport

COLLECTIVE = trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE


@pytest.fixture(scope="module")
def trainer(start_trainer, tiny_model_dir: Path, rollout_server) -> Iterator[dict]:
    from rlfabric.v1 import trainer_pb2_grpc

    group, address = start_trainer("--hf-dir", str(tiny_model_dir), "--tp", "1", "--pp", "1", "--lr", "1e-2",
                                   "--micro-batch-size", "4", "--forward-micro-batch-size", "4")
    server, _ = rollout_server
    channel = grpc.insecure_channel(address)
    try:
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "work": group.log_path.parent, "address": address,
               "rollout_address": server.address}
    finally:
        channel.close()
        group.stop(grace_s=12)
        restore_checkpoint_weights(server.address, tiny_model_dir)  # the trained weights must not leak out


def _push(stub, address: str, version: int, plan, targets: list[str] | None = None) -> list:
    return list(stub.PushWeights(trainer_pb2.PushWeightsRequest(
        version=version, targets=targets or [address], bucket_bytes=BUCKET_BYTES, plan=plan, transport=COLLECTIVE),
        timeout=120))


def _member_group() -> str | None:
    from services.rollout.weights import COLLECTIVE as RECEIVER

    return RECEIVER._id


def test_collective_pushes_deliver_the_trainers_weights_bitwise_and_keep_the_group(trainer, rollout_stub,
                                                                                   rollout_engine, tiny_model_dir):
    from services.trainer.convert import load_hf_state

    stub, address = trainer["stub"], trainer["rollout_address"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    groups = []
    for _ in range(2):  # the second push reuses the group the first one formed
        held = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
        assert _update(stub, held) == held + 1
        version = _next_version(stub, address)
        progress = _push(stub, address, version, plan)
        done = [p for p in progress if p.done]
        assert len(done) == 1 and done[0].target == address and done[0].bytes_sent == done[0].bytes_total > 0
        assert rollout_version(address) == version
        assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version == version
        groups.append(_member_group())

        state = load_hf_state(_converted_weights(stub, trainer["work"], tiny_model_dir))
        assert_engine_holds(rollout_engine, state)  # every vLLM parameter, bit for bit
    assert groups[0] is not None and groups[0] == groups[1]


def test_checksum_acknowledged_is_the_trainers(trainer, rollout_stub, tiny_model_dir):
    """The acknowledged checksum is the one of the trainer's converted weights, bucketed as the transport does."""
    from services.trainer.convert import load_hf_state

    stub, address = trainer["stub"], trainer["rollout_address"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    version = _next_version(stub, address)
    progress = _push(stub, address, version, plan)
    acked = [p.checksum for p in progress if p.done]
    state = load_hf_state(_converted_weights(stub, trainer["work"], tiny_model_dir))
    buckets = GrpcStreamTransport([address], bucket_bytes=BUCKET_BYTES).buckets(version, ((t.name, state[t.name])
                                                                                  for t in plan.tensors))
    assert acked == [combine_checksums([c.bucket.checksum for c, _ in buckets])]


def test_a_dead_target_fails_the_whole_push_at_once_naming_it(trainer, rollout_stub, tiny_model_dir):
    stub, address = trainer["stub"], trainer["rollout_address"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    held = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version
    before = rollout_version(address)
    dead = "127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(grpc.RpcError) as e:
        _push(stub, address, _next_version(stub, address), plan, targets=[address, dead])
    # UNAVAILABLE, not the call's DEADLINE_EXCEEDED: the group noticed the dead stream instead of waiting.
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    details = e.value.details()
    assert dead in details and address in details and "left the collective group" in details
    assert rollout_version(address) == before  # the group fails as one: the healthy replica applied nothing
    assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version == held
    # The sender answers only after the healthy replica answered its ended stream, and the replica answers
    # only after it left the group (services/common/transports/collective.py): no wait here.
    assert _member_group() is None


def test_a_replica_slow_to_read_a_failed_push_leaves_the_group_before_the_push_fails(
        trainer, rollout_stub, tiny_model_dir, monkeypatch):
    """The racy order made certain: the dead target is noticed before the healthy replica reads its first
    bucket. A cancelled stream would end before the replica saw the new group, and it would keep the old one."""
    import services.rollout.update_stream as update_stream

    stub, address = trainer["stub"], trainer["rollout_address"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    _push(stub, address, _next_version(stub, address), plan)
    assert _member_group() is not None  # a member of the group of [address]
    stager = update_stream.WeightStager

    def slow_stager(*args, **kwargs):
        time.sleep(1.0)  # before the handler reads its first message: the sender fails the push meanwhile
        return stager(*args, **kwargs)

    monkeypatch.setattr(update_stream, "WeightStager", slow_stager)
    before = rollout_version(address)
    with pytest.raises(grpc.RpcError) as e:
        _push(stub, address, _next_version(stub, address), plan, targets=[address, "127.0.0.1:9"])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "left the collective group" in e.value.details()
    assert rollout_version(address) == before
    assert _member_group() is None


def test_a_restarted_replica_is_refused_then_joins_the_next_group(trainer, rollout_stub, tiny_model_dir):
    from services.rollout.weights import COLLECTIVE as RECEIVER

    stub, address = trainer["stub"], trainer["rollout_address"]
    plan = _explicit_plan(stub, rollout_stub, tiny_model_dir)
    version = _next_version(stub, address)
    _push(stub, address, version, plan)  # forms (or keeps) a group with this replica
    formed = _member_group()
    RECEIVER.close()  # what a restart does: the replica is no member of the trainer's kept group
    with pytest.raises(grpc.RpcError) as e:
        _push(stub, address, version + 1, plan)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not a member" in e.value.details()
    assert rollout_version(address) == version
    _push(stub, address, version + 1, plan)  # the failure dropped the group: a new one forms
    assert rollout_version(address) == version + 1
    assert _member_group() not in (None, formed)


def test_coordinator_configured_collective_pushes_and_falls_back_to_grpc(trainer, rollout_stub, rollout_server,
                                                                          tiny_model_dir):
    from services.coordinator.weight_sync import Replica, WeightSync
    from services.rollout.weights import COLLECTIVE as RECEIVER

    address = trainer["rollout_address"]
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    sync = WeightSync(trainer["stub"], [Replica(address, rollout_stub)], hf_config, 120,
                      actor_address=trainer["address"], transport="collective")
    assert sync.transports == {address: COLLECTIVE}  # not shm, though the replica shares the actor's host
    version = _next_version(trainer["stub"], address)
    sync.push(version)
    assert sync.version == version == rollout_version(address)
    group = _member_group()
    assert group is not None
    RECEIVER.close()  # the collective push fails; the coordinator sends the version over gRPC at once
    sync.push(version + 1)
    assert sync.version == version + 1 == rollout_version(address)
    assert sync.transports == {address: COLLECTIVE}  # the next push forms a new group
    assert _member_group() is None
    sync.push(version + 2)
    assert rollout_version(address) == version + 2 and _member_group() not in (None, group)
