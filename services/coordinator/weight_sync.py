"""Weight sync as the coordinator drives it: the rollout replicas it talks to, and `WeightSync`.

The resharding plan itself is `services/coordinator/resharding.py` (a pure function); this module asks the
services for their layouts, caches the plans, and has the actor push each new weights version to every
replica, which must acknowledge it.

The transport is chosen per replica by `rlfabric.weight_transport`: `auto` (the default) takes
`WEIGHT_TRANSPORT_SHM` when the replica's address and the actor's name the same host (`same_host`), gRPC
otherwise; `grpc` takes gRPC for every replica; `collective` puts every replica in one collective group
(services/common/transports/collective.py). A replica that fails an shm push (it cannot map the segment:
another container, /dev/shm not shared) gets the same version again over gRPC at once, and gRPC from then on;
one that fails a collective push (the group fails as one) gets it over gRPC at once too, and stays collective:
the next push forms a new group.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.common.config.sections import WEIGHT_TRANSPORTS
from services.coordinator.errors import IterationError

logger = logging.getLogger(__name__)
GRPC = trainer_pb2.WEIGHT_TRANSPORT_GRPC_STREAM
SHM = trainer_pb2.WEIGHT_TRANSPORT_SHM
COLLECTIVE = trainer_pb2.WEIGHT_TRANSPORT_COLLECTIVE


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


@functools.lru_cache(maxsize=256)
def _machine_ids(host: str) -> frozenset[str]:
    """The addresses `host` resolves to, with every address of this machine (loopback included) as "local"."""
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return frozenset({host})
    try:
        own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        own = set()
    return frozenset("local" if ip in own or ipaddress.ip_address(ip.split("%")[0]).is_loopback else ip
                     for ip in ips)


def same_host(a: str, b: str) -> bool:
    """Whether two "host:port" endpoints are on one machine (equal names, or resolving to a shared address)."""
    ha, hb = _host(a), _host(b)
    return ha == hb or bool(_machine_ids(ha) & _machine_ids(hb))


@dataclass
class Replica:
    """A rollout replica the coordinator talks to."""

    address: str
    stub: Any  # rollout_pb2_grpc.RolloutStub


class WeightSync:
    """Pushes the actor's weights to the rollout replicas, with the resharding plan this coordinator computes.

    The plan comes from `Trainer.Info` and `Rollout.Info` (both with parameters); replicas that load different
    parameter sets get their own plan. Plans are computed once and reused for every push: layouts do not change
    during a run, and a failed push drops them so the next push asks the services again. Every replica must
    acknowledge the version, or leave the run: a replica that cannot be reached (UNAVAILABLE: its process died
    between its last stream and this push) is taken out of the run's `ReplicaSet` (`lose`, as the generator
    does when its stream breaks) while another replica holds the version; with none left the push fails
    naming them. A lost replica comes back through `ReplicaSet.refresh` and is synced before it serves.

    Attributes:
        version: the last version every replica acknowledged (None before the first push, or after a failed one).
    """

    def __init__(self, actor: Any, replicas: Sequence[Replica], hf_config: dict[str, Any], deadline_s: float,
                 actor_address: str | None = None, transport: str = "auto") -> None:
        if transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight transport {transport!r} is not one of {WEIGHT_TRANSPORTS}")
        self.actor = actor
        # A replica that joins mid-run gets this one (auto: gRPC, its host unchecked).
        self.default_transport = COLLECTIVE if transport == "collective" else GRPC
        # Without the actor's address nothing is known to be on its host: gRPC for every replica.
        self.transports = {r.address: SHM if transport == "auto" and actor_address and same_host(actor_address, r.address)
                           else self.default_transport for r in replicas}
        logger.info("weight sync transports: %s", {a: trainer_pb2.WeightTransport.Name(t)
                                                    for a, t in self.transports.items()})
        self.replicas = replicas if isinstance(replicas, list) else list(replicas)  # the run's ReplicaSet, shared
        self.hf_config = hf_config
        self.deadline_s = deadline_s
        self.version: int | None = None
        self._plans: list[tuple[list[str], trainer_pb2.ReshardPlan]] | None = None  # (targets, plan) per replica layout

    def _plan(self) -> list[tuple[list[str], trainer_pb2.ReshardPlan]]:
        from services.coordinator.resharding import plan_resharding

        groups: dict[tuple, tuple[list[str], Any]] = {}
        for r in list(self.replicas):
            try:
                params = r.stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True),
                                     timeout=self.deadline_s).parameters
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or not self._lose([r.address], e.details() or ""):
                    raise
                continue
            signature = tuple((p.name, tuple(p.shape), p.dtype) for p in params)
            groups.setdefault(signature, ([], params))[0].append(r.address)
        # Part of the push, under its deadline: the trainer lists its shards on its ranks, after what they are doing.
        listing = trainer_pb2.TrainerInfoRequest(include_parameters=True)
        shards = self.actor.Info(listing, timeout=self.deadline_s).shards
        return [(targets, plan_resharding(shards, params, self.hf_config).to_proto())
                for targets, params in groups.values()]

    def push(self, version: int) -> None:
        self.version = None
        try:
            if self._plans is None or _targets(self._plans) != sorted(r.address for r in self.replicas):
                self._plans = self._plan()  # first push, or replicas were lost or joined since the last one
            for targets, plan in self._plans:
                self._push(targets, version, plan)
        except (grpc.RpcError, IterationError) as e:
            self._plans = None  # a replica may have restarted with another layout: plan afresh next time
            if isinstance(e, IterationError):
                raise
            raise IterationError(f"weight sync: {e.code().name}: {e.details()}") from e
        self.version = version

    def _push(self, targets: list[str], version: int, plan: trainer_pb2.ReshardPlan) -> None:
        acked: set[str] = set()
        errors: list[str] = []
        transport_of = {t: self.transports.get(t, self.default_transport) for t in targets}
        for transport in (SHM, COLLECTIVE, GRPC):
            group = [t for t in targets if transport_of[t] == transport]
            if group:
                acked |= self._push_once(group, version, plan, transport, errors)
        fallback = [t for t in targets if t not in acked and transport_of[t] in (SHM, COLLECTIVE)]
        if fallback:
            logger.warning("weight sync: replicas %s did not apply version %d over %s (%s); sending it over gRPC",
                           fallback, version, "shared memory or the collective group", "; ".join(errors))
            for t in fallback:
                if transport_of[t] == SHM:
                    self.transports[t] = GRPC  # no shared /dev/shm: that does not change during a run
            acked |= self._push_once(fallback, version, plan, GRPC, errors)
        missing = sorted(set(targets) - acked)
        if missing and not (acked and self._lose(missing, "; ".join(errors))):
            raise IterationError(f"weight sync: replicas {missing} did not acknowledge version {version}"
                                 + (f": {'; '.join(errors)}" if errors else ""))

    def _lose(self, addresses: list[str], why: str) -> bool:
        """Takes unreachable replicas out of the run when another one is left; False when that is not possible."""
        lose = getattr(self.replicas, "lose", None)  # a ReplicaSet; a fixed list of replicas cannot shrink
        gone = [r for r in self.replicas if r.address in addresses]
        if lose is None or len(gone) >= len(self.replicas):
            return False
        for replica in gone:
            lose(replica, f"unreachable at the weight push: {why}")
        return True

    def _push_once(self, targets: Iterable[str], version: int, plan: trainer_pb2.ReshardPlan, transport: int,
                   errors: list[str]) -> set[str]:
        """One PushWeights; returns the targets that acknowledged. A target's failure (UNAVAILABLE, after the
        others' acknowledgements) is recorded in `errors`; any other error of the call is raised."""
        acked: set[str] = set()
        request = trainer_pb2.PushWeightsRequest(version=version, targets=list(targets), plan=plan, transport=transport)
        try:
            for progress in self.actor.PushWeights(request, timeout=self.deadline_s):
                if progress.done:
                    acked.add(progress.target)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            errors.append(e.details() or "")
        return acked


def _targets(plans: list[tuple[list[str], trainer_pb2.ReshardPlan]]) -> list[str]:
    return sorted(a for targets, _ in plans for a in targets)
