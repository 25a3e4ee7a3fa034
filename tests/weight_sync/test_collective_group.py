"""The collective group's pieces without an engine: where the trainer's store listens, what a replica refuses
before it touches the network, and a rendezvous the sender gives up on (the end-to-end cases are in
test_collective.py)."""

from __future__ import annotations

import threading

import pytest

from rlfabric.v1 import common_pb2
from services.common.transports.collective import CollectiveReceiver, _SenderGroup
from services.common.transports.collective_group import CollectiveError

GLOO = common_pb2.COLLECTIVE_BACKEND_GLOO


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (/proc/net/tcp, IPv4), as dotted quads."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def _bucket(ref: common_pb2.CollectiveRef, data: bytes = b"") -> common_pb2.WeightBucket:
    bucket = common_pb2.WeightBucket(version=1, index=0, collective=ref)
    named = bucket.tensors.add(name="w")
    named.tensor.dtype = common_pb2.DTYPE_FLOAT32
    named.tensor.shape.extend([2, 3])
    named.tensor.data = data
    return bucket


def test_the_store_listens_only_on_the_route_to_the_targets():
    group = _SenderGroup.create(["127.0.0.1:5000"], GLOO, 5.0)
    port = int(group.address.rsplit(":", 1)[1])
    assert group.address.startswith("127.0.0.1:")
    assert _listening_addresses(port) == {"127.0.0.1"}  # not 0.0.0.0: torch's own store listens everywhere
    assert len(group.group_id) == 32  # 128 random bits: the secret prefix of the group's keys
    assert group.ref("p").world_size == 2


@pytest.mark.parametrize(("change", "needle"), [
    ({"backend": common_pb2.COLLECTIVE_BACKEND_UNSPECIFIED}, "backend"),
    ({"timeout_s": 0.0}, "timeout_s"),
    ({"world_size": 1}, "world_size"),
])
def test_the_replica_refuses_a_malformed_group_before_dialing(change, needle):
    ref = common_pb2.CollectiveRef(store_address="127.0.0.1:9", group_id="g" * 32, world_size=2, backend=GLOO,
                                   timeout_s=5.0, push_id="p")
    for key, value in change.items():
        setattr(ref, key, value)
    with pytest.raises(CollectiveError) as e:
        CollectiveReceiver().receive(_bucket(ref))
    assert e.value.code == "INVALID_ARGUMENT" and needle in str(e.value)


def test_bytes_in_the_message_are_refused():
    ref = common_pb2.CollectiveRef(store_address="127.0.0.1:9", group_id="g", world_size=2, backend=GLOO,
                                   timeout_s=5.0)
    with pytest.raises(CollectiveError) as e:
        CollectiveReceiver().receive(_bucket(ref, data=b"\0" * 24))
    assert e.value.code == "INVALID_ARGUMENT" and "not `data`" in str(e.value)


def test_a_joined_replica_fails_at_once_when_the_sender_gives_up_and_extra_joiners_are_refused():
    group = _SenderGroup.create(["127.0.0.1:5000"], GLOO, 30.0)
    receiver = CollectiveReceiver()
    errors: list[CollectiveError] = []

    def join() -> None:
        try:
            receiver.receive(_bucket(group.ref("p")))
        except CollectiveError as e:
            errors.append(e)

    worker = threading.Thread(target=join)
    worker.start()
    assert group.keys.wait(["joined"]) is None and group.keys.add("joined", 0) == 1  # the replica took rank 1
    group.keys.set("go", "abort: target x left")
    worker.join(timeout=20)
    assert not worker.is_alive()  # well within its 30 s group timeout
    assert [(e.code, "gave up" in str(e) and "target x left" in str(e)) for e in errors] == [("UNAVAILABLE", True)]

    with pytest.raises(CollectiveError) as e:  # the group (world 2) is complete: a newcomer is no member
        CollectiveReceiver().receive(_bucket(group.ref("p")))
    assert e.value.code == "UNAVAILABLE" and "not a member" in str(e.value)


def test_bytes_arrive_by_broadcast_and_a_member_that_leaves_fails_the_next_one_at_once():
    import torch

    from services.common.transports.collective_group import broadcast, new_process_group

    group = _SenderGroup.create(["127.0.0.1:5000"], GLOO, 30.0)
    receiver = CollectiveReceiver()
    got: list = []
    worker = threading.Thread(target=lambda: got.extend(receiver.receive(_bucket(group.ref("p")))))
    worker.start()
    group.keys.wait(["joined"])
    group.keys.set("go", "go")
    group.pg = new_process_group(GLOO, group.keys, 0, 2, 30.0, group.host)
    group.keys.wait(["p/ready/0"])
    sent = torch.arange(24, dtype=torch.uint8)
    broadcast(group.pg, sent)
    worker.join(timeout=30)
    assert [bytes(a) for a in got] == [bytes(sent.numpy())]

    receiver.close()  # its connections close, as a dead replica's do
    with pytest.raises(CollectiveError) as e:
        broadcast(group.pg, sent)
    assert e.value.code == "UNAVAILABLE"  # not DEADLINE_EXCEEDED: no wait for the 30 s group timeout
