"""The run's rollout replicas as one shared, changing set: replicas are lost mid-iteration and join between.

`ReplicaSet` is a list of `Replica` that the generator, the weight sync and the placement all hold (the same
object, never a copy), so a change is seen by every phase at once:
- `lose(replica)`: the generator found the replica's stream broken (a SIGKILLed process, a host that went
  silent past the channel's keepalive). It leaves the set at once; its unfinished groups are re-sent to the
  others by the generator (services/coordinator/generation.py). Its address is quarantined: its registration
  outlives it by up to its lease, and a dead replica must not rejoin.
- `refresh()`: called right before each weight push (services/coordinator/placement.py). Registered replicas
  not in the set join it (a quarantined address only once it answers `Info` again: it came back), so the push
  that follows gives them the version the next iteration generates at. A replica therefore never serves
  weights other than the run's: a new or restarted one loads the HF folder (version 0) and is synced before
  any group is dealt to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from rlfabric.v1 import rollout_pb2
from services.common.deadlines import REJOIN_PROBE_DEADLINE_S
from services.common.service_kind import ServiceKind
from services.coordinator.weight_sync import Replica

logger = logging.getLogger(__name__)


class ReplicaSet(list[Replica]):
    """Rollout replicas (see module doc).

    Args:
        replicas: the replicas the run starts with.
        registry: the Redis `Registry` new replicas are found in (None: the set only shrinks).
        connect: address -> Replica (the coordinator's channel, with its token).
    """

    def __init__(self, replicas: Iterable[Replica], registry: object | None = None,
                 connect: Callable[[str], Replica] | None = None) -> None:
        super().__init__(replicas)
        self.registry = registry
        self._connect = connect
        self.quarantined: set[str] = set()
        self.lost_count = 0
        self.joined_count = 0

    def lose(self, replica: Replica, why: str) -> None:
        """Takes `replica` out of the set (idempotent) and quarantines its address."""
        if replica in self:
            self.remove(replica)
            self.lost_count += 1
            logger.warning("rollout replica %s lost (%s); %d left", replica.address, why, len(self))
        self.quarantined.add(replica.address)

    def refresh(self) -> list[Replica]:
        """Adds the registered replicas not in the set; returns them (they need the current weights)."""
        if self.registry is None or self._connect is None:
            return []
        held = {r.address for r in self}
        joined = []
        for member in self.registry.members(ServiceKind.ROLLOUT):
            address = member.endpoint
            if address in held:
                continue
            replica = self._connect(address)
            if address in self.quarantined and not _answers(replica):
                continue
            self.quarantined.discard(address)
            self.append(replica)
            held.add(address)
            joined.append(replica)
            self.joined_count += 1
            logger.info("rollout replica %s joins the run (synced before it serves)", address)
        return joined


def _answers(replica: Replica) -> bool:
    try:
        replica.stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=REJOIN_PROBE_DEADLINE_S)
    except grpc.RpcError:
        return False
    return True
