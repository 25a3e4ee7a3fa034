"""How the coordinator tells that a replica shares the actor's host (the shm transport's condition), and which
transports exist."""

from __future__ import annotations

import socket

from services.coordinator.weight_sync import same_host


def test_loopback_names_and_this_machines_own_name_are_one_host():
    assert same_host("127.0.0.1:5000", "127.0.0.1:6000")
    assert same_host("localhost:5000", "127.0.0.1:6000")
    assert same_host("[::1]:5000", "127.0.0.1:6000")
    assert same_host(f"{socket.gethostname()}:5000", "127.0.0.1:6000")


def test_other_hosts_are_not_the_same_host():
    assert not same_host("127.0.0.1:5000", "192.0.2.10:6000")  # TEST-NET-1: never this machine
    assert not same_host("192.0.2.10:5000", "192.0.2.11:6000")
    assert same_host("192.0.2.10:5000", "192.0.2.10:6000")
    assert not same_host("no-such-host.invalid:1", "127.0.0.1:2")


def test_the_proto_lists_exactly_the_transports_that_exist():
    from rlfabric.v1 import trainer_pb2
    from services.common.transports import TRANSPORTS, GrpcStreamTransport, ShmTransport

    listed = {v.number for v in trainer_pb2.WeightTransport.DESCRIPTOR.values} - {trainer_pb2.WEIGHT_TRANSPORT_UNSPECIFIED}
    assert set(TRANSPORTS) == listed
    assert TRANSPORTS[trainer_pb2.WEIGHT_TRANSPORT_SHM] is ShmTransport
    assert TRANSPORTS[trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM] is GrpcStreamTransport


def test_configured_transport_decides_per_replica():
    import pytest

    from rlfabric.v1 import trainer_pb2
    from services.coordinator.weight_sync import Replica, WeightSync

    replicas = [Replica("127.0.0.1:5000", None), Replica("192.0.2.10:5000", None)]  # on the actor's host, another
    chosen = {t: WeightSync(None, replicas, {}, 10, actor_address="127.0.0.1:6000", transport=t).transports
              for t in ("auto", "grpc", "collective")}
    grpc_, shm, coll = (trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM, trainer_pb2.WEIGHT_TRANSPORT_SHM,
                        trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE)
    assert chosen["auto"] == {"127.0.0.1:5000": shm, "192.0.2.10:5000": grpc_}
    assert chosen["grpc"] == {"127.0.0.1:5000": grpc_, "192.0.2.10:5000": grpc_}
    assert chosen["collective"] == {"127.0.0.1:5000": coll, "192.0.2.10:5000": coll}
    with pytest.raises(ValueError, match="'nccl' is not one of"):
        WeightSync(None, replicas, {}, 10, transport="nccl")
