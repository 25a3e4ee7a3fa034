"""Weight sync as the coordinator drives it: the rollout replicas it talks to, and `WeightSync`.

The resharding plan itself is `services/coordinator/resharding.py` (a pure function); this module asks the
services for their layouts, caches the plans, and has the actor push each new weights version to every
replica, which must acknowledge it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.coordinator.errors import IterationError


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
    acknowledge the version, or the push fails naming the ones that did not.

    Attributes:
        version: the last version every replica acknowledged (None before the first push, or after a failed one).
    """

    def __init__(self, actor: Any, replicas: Sequence[Replica], hf_config: dict[str, Any], deadline_s: float) -> None:
        self.actor = actor
        self.replicas = list(replicas)
        self.hf_config = hf_config
        self.deadline_s = deadline_s
        self.version: int | None = None
        self._plans: list[tuple[list[str], trainer_pb2.ReshardPlan]] | None = None  # (targets, plan) per replica layout

    def _plan(self) -> list[tuple[list[str], trainer_pb2.ReshardPlan]]:
        from services.coordinator.resharding import plan_resharding

        groups: dict[tuple, tuple[list[str], Any]] = {}
        for r in self.replicas:
            params = r.stub.Info(rollout_pb2.RolloutInfoRequest(include_parameters=True), timeout=60).parameters
            signature = tuple((p.name, tuple(p.shape), p.dtype) for p in params)
            groups.setdefault(signature, ([], params))[0].append(r.address)
        shards = self.actor.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=60).shards
        return [(targets, plan_resharding(shards, params, self.hf_config).to_proto())
                for targets, params in groups.values()]

    def push(self, version: int) -> None:
        self.version = None
        try:
            if self._plans is None:
                self._plans = self._plan()
            for targets, plan in self._plans:
                self._push(targets, version, plan)
        except (grpc.RpcError, IterationError) as e:
            self._plans = None  # a replica may have restarted with another layout: plan afresh next time
            if isinstance(e, IterationError):
                raise
            raise IterationError(f"weight sync: {e.code().name}: {e.details()}") from e
        self.version = version

    def _push(self, targets: list[str], version: int, plan: trainer_pb2.ReshardPlan) -> None:
        acked: dict[str, int] = {}
        request = trainer_pb2.PushWeightsRequest(version=version, targets=targets, plan=plan)
        for progress in self.actor.PushWeights(request, timeout=self.deadline_s):
            if progress.done:
                acked[progress.target] = progress.checksum
        missing = sorted(set(targets) - set(acked))
        if missing:
            raise IterationError(f"weight sync: replicas {missing} did not acknowledge version {version}")
