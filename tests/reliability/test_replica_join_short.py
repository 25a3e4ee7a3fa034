"""The CI variant of test_rollout_failover.py's soak test of a replica that joins a run: a replica registered
after the run's replica set was made joins it at the next weight push (`Placement.after_update`), is synced to
that version, and then serves the run's groups at it.

The joiner is the session's in-process rollout server (no second vLLM engine): the set starts without it, so the
push can only reach it by the join. The registry is the session's Redis under a prefix of this test's own, so
registrations other tests leave behind (a killed replica's lease) cannot join.
"""

from __future__ import annotations

import json

from rlfabric.v1 import rollout_pb2, trainer_pb2_grpc
from services.common.client import make_channel
from services.common.redis_store import Registry, connect
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.replicas import ReplicaSet
from tests.reliability.test_rollout_failover import (
    CountingScore,
    check_groups,
    connect_replica,
    make_generator,
    prompts,
)


def test_a_replica_that_registers_joins_at_the_next_push_synced_before_it_serves(
        rollout_server, rollout_engine, redis_url, reward_score, tiny_settings, tiny_model_dir, start_trainer) -> None:
    from services.coordinator.placement import OffloadKeys, Placement
    from services.coordinator.weight_sync import WeightSync

    server, _ = rollout_server
    _group, actor_address = start_trainer("--hf-dir", str(tiny_model_dir))
    channels: list = []
    connect_to = connect_replica(channels)
    channels.append(make_channel(actor_address))
    actor = trainer_pb2_grpc.TrainerStub(channels[-1])
    registry = Registry(connect(redis_url), prefix="replica-join-short")
    replica_set = ReplicaSet([], registry, connect_to)
    sync = WeightSync(actor, replica_set, json.loads((tiny_model_dir / "config.json").read_text()), 300.0)
    placement = Placement(False, actor, None, replica_set, sync, OffloadKeys(False, False, False), 300.0)
    try:
        before = rollout_engine.weights_version
        version = before + 1
        with registry.register("rollout", "joiner", server.address):
            placement.after_update(PhaseClock(), version)  # what the iteration does after its update
            assert replica_set.refresh() == []  # a member already held does not join twice
        assert [r.address for r in replica_set] == [server.address] and replica_set.joined_count == 1
        (joined,) = replica_set
        assert joined.stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version == version > before
        score = CountingScore(reward_score)
        generator = make_generator(replica_set, score, tiny_settings, tiny_model_dir)
        check_groups(generator.generate(prompts("joined"), version, PhaseClock()), "joined",
                     tiny_settings.n_samples_per_prompt, score)
    finally:
        for c in channels:
            c.close()


def test_a_replica_unreachable_at_the_push_leaves_the_run_and_the_others_get_the_version(
        rollout_server, rollout_engine, tiny_model_dir, start_trainer) -> None:
    """The replica died after its last stream (so the generator never saw it go): the push, not the run, fails
    for it; it leaves the set, the survivor holds the version. Alone, it fails the push naming it."""
    import socket

    import pytest

    from services.coordinator.errors import IterationError
    from services.coordinator.weight_sync import WeightSync

    server, _ = rollout_server
    _group, actor_address = start_trainer("--hf-dir", str(tiny_model_dir))
    with socket.socket() as s:  # a port nothing listens on: a dead replica's address
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    channels: list = []
    connect_to = connect_replica(channels)
    channels.append(make_channel(actor_address))
    actor = trainer_pb2_grpc.TrainerStub(channels[-1])
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    try:
        replica_set = ReplicaSet([connect_to(server.address), connect_to(dead)])
        version = rollout_engine.weights_version + 1
        sync = WeightSync(actor, replica_set, hf_config, 300.0)
        sync.push(version)
        assert sync.version == version and [r.address for r in replica_set] == [server.address]
        assert replica_set.lost_count == 1 and dead in replica_set.quarantined
        assert rollout_engine.weights_version == version
        alone = ReplicaSet([connect_to(dead)])
        with pytest.raises(IterationError, match=dead):
            WeightSync(actor, alone, hf_config, 300.0).push(version + 1)
        assert [r.address for r in alone] == [dead]
    finally:
        for c in channels:
            c.close()
