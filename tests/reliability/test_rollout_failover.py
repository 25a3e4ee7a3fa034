"""A rollout replica (of two) SIGKILLed mid-iteration: its unfinished groups go to the survivor, every sample
is kept and scored exactly once (sample ids checked), the generation finishes; the dead replica leaves the
run's ReplicaSet, and a replica that registers afterwards joins it (to be synced before it serves).

Replica A is the session's in-process server (tests/conftest.py); replica B a `rlfabric rollout serve`
process, killed with SIGKILL once the first of its samples has arrived.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest

from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2_grpc
from services.common.client import make_channel
from services.common.redis_store import Registry, connect
from services.coordinator.generation import Generator, GroupPrompt
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.replicas import ReplicaSet
from services.coordinator.weight_sync import Replica

GROUPS = 12


def prompts(tag: str) -> list[GroupPrompt]:
    rng = np.random.default_rng(7)
    return [GroupPrompt(f"{tag}/p{i}", rng.integers(5, 200, size=12).astype(np.int32), str(i)) for i in range(GROUPS)]


class CountingScore:
    """The reward stream, counting every ScoreRequest by sample id (a sample scored twice shows)."""

    def __init__(self, score) -> None:
        self.score = score
        self.requested: Counter = Counter()
        self.on_request = lambda _request: None

    def __call__(self, requests):
        def counted():
            for r in requests:
                self.requested[r.sample_id] += 1
                self.on_request(r)
                yield r

        return self.score(counted())


def connect_replica(channels: list):
    def connect_to(address: str) -> Replica:
        channels.append(make_channel(address))
        return Replica(address, rollout_pb2_grpc.RolloutStub(channels[-1]))
    return connect_to


def check_groups(groups, tag: str, n: int, score: CountingScore) -> None:
    assert [g.group_id for g in groups] == [f"{tag}/p{i}" for i in range(GROUPS)]
    for g in groups:
        ids = [f"{g.group_id}/{i}" for i in range(n)]
        assert [x.sample_id for x in g.samples] == ids
        assert [s.sample_id for s in g.scores] == ids  # each sample carries its own score
        assert all(not x.error and x.response_length > 0 for x in g.samples)
    assert score.requested == Counter({f"{tag}/p{i}/{j}": 1 for i in range(GROUPS) for j in range(n)})


def make_generator(replica_set, score, settings, tiny_model_dir) -> Generator:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return Generator(replica_set, score, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), settings)


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)],
                         ids=["SIGKILL", "SIGSTOP"])
def test_one_of_two_replicas_lost_mid_iteration_finishes_on_the_survivor(
        sig, rollout_server, replicas, redis_url, reward_score, tiny_settings, tiny_model_dir) -> None:
    """SIGKILL: the stream breaks at once. SIGSTOP: the replica is alive and silent; the channel's keepalive
    declares it dead within seconds."""
    server, _ = rollout_server
    replicas.start("replica-b")
    channels: list = []
    connect_to = connect_replica(channels)
    a, b = connect_to(server.address), connect_to(replicas.address("replica-b"))
    n = tiny_settings.n_samples_per_prompt
    try:
        replica_set = ReplicaSet([a, b], Registry(connect(redis_url)), connect_to)
        score = CountingScore(reward_score)
        generator = make_generator(replica_set, score, tiny_settings, tiny_model_dir)
        check_groups(generator.generate(prompts("warm"), 0, PhaseClock()), "warm", n, score)  # first-call costs
        score = generator.score = CountingScore(reward_score)
        started = time.monotonic()
        check_groups(generator.generate(prompts("normal"), 0, PhaseClock()), "normal", n, score)
        normal_s = time.monotonic() - started
        assert generator.take_failover_metrics()["rollout/replicas_lost"] == 0

        # B's groups are the odd ones (dealt round-robin): B dies once the first of its samples is in.
        score = generator.score = CountingScore(reward_score)
        killed = threading.Event()

        def kill_b_on_its_first_sample(request) -> None:
            if int(request.sample_id.split("/")[1][1:]) % 2 and not killed.is_set():
                killed.set()
                replicas.signal("replica-b", sig)

        score.on_request = kill_b_on_its_first_sample
        started = time.monotonic()
        groups = generator.generate(prompts("kill"), 0, PhaseClock())
        killed_s = time.monotonic() - started
        assert killed.is_set()
        check_groups(groups, "kill", n, score)  # every sample kept and scored exactly once
        failover = generator.take_failover_metrics()
        assert failover["rollout/replicas_lost"] == 1
        assert 1 <= failover["rollout/groups_resent"] <= GROUPS // 2  # only B's unfinished groups
        assert list(replica_set) == [a] and replica_set.lost_count == 1
        # The dead replica's registration outlives it (its lease): it must not rejoin.
        assert replica_set.refresh() == [] and list(replica_set) == [a]
        print(f"\nreplica-{sig.name} generation: {killed_s:.1f} s (normal {normal_s:.1f} s, {killed_s / normal_s:.2f}x); "
              f"{failover['rollout/groups_resent']:.0f} groups re-sent, "
              f"{failover['rollout/duplicate_samples_dropped']:.0f} re-sampled duplicates dropped")
    finally:
        for c in channels:
            c.close()


@pytest.mark.slow  # CI variant (the joiner is the session's replica): test_replica_join_short.py
def test_a_replica_that_joins_is_synced_to_the_runs_version_before_it_serves(
        rollout_server, rollout_engine, replicas, redis_url, reward_score, tiny_settings, tiny_model_dir,
        start_trainer) -> None:
    from services.coordinator.placement import OffloadKeys, Placement
    from services.coordinator.weight_sync import WeightSync

    server, _ = rollout_server
    _group, actor_address = start_trainer("--hf-dir", str(tiny_model_dir))  # the HF weights: A's stay as they are
    channels: list = []
    connect_to = connect_replica(channels)
    actor = trainer_pb2_grpc.TrainerStub(make_channel(actor_address))
    a = connect_to(server.address)
    replica_set = ReplicaSet([a], Registry(connect(redis_url)), connect_to)
    sync = WeightSync(actor, replica_set, json.loads((tiny_model_dir / "config.json").read_text()), 300.0)
    placement = Placement(False, actor, None, replica_set, sync, OffloadKeys(False, False, False), 300.0)
    try:
        replicas.start("replica-c")
        c_address = replicas.address("replica-c")
        version = rollout_engine.weights_version + 1
        placement.after_update(PhaseClock(), version)  # what the iteration does after its update
        assert [r.address for r in replica_set] == [a.address, c_address]
        held = {r.address: r.stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30).weights_version
                for r in replica_set}
        assert held == {a.address: version, c_address: version}  # C was at 0 (HF folder) when it registered
        score = CountingScore(reward_score)
        generator = make_generator(replica_set, score, tiny_settings, tiny_model_dir)
        check_groups(generator.generate(prompts("joined"), version, PhaseClock()), "joined", 4, score)
    finally:
        for c in channels:
            c.close()
