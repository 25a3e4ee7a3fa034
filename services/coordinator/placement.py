"""Where the actor, the reference and the rollout run, and what that asks of the iteration between its phases.

Disaggregated (`rl_config.use_integrated_worker: false`): each service has devices of its own. The reference
streams its log-probs during the rollout, and the new weights are pushed to the replicas right after the
update (timed as `resharding_enter_infer`: entering inference for the next iteration).

Integrated (`use_integrated_worker: true`, MindSpeed-RL's all-shared-device mode): actor, reference and rollout
share the same devices, so each gives up its memory while another works. The coordinator sequences what
MindSpeed-RL's actor worker, sharding manager and integrated worker do in one process:

| step | calls | timed as |
|---|---|---|
| enter inference | rollout `Wake`; weight sync unless the replicas hold the version; actor `Offload(params)` if `offload_train_param` | `resharding_enter_infer` |
| generate + score | (the rollout) | `rollout`, `rule_reward` |
| exit inference | rollout `Sleep` | `resharding_exit_infer` |
| reference pass | reference `Onload(params)`, `ComputeLogProbs`, `Offload(params)` | `ref_onload`, `reference_model`, `ref_offload` |
| old log-probs | actor `Onload(params)` if `offload_train_param` | (not timed, as upstream) |
| enter training | actor `Onload` of what the `offload_train_*` keys offloaded | `resharding_enter_train` |
| update | (the update) | `update` |
| exit training | actor `Offload(grads, optimizer)` per `offload_train_grad` / `offload_train_optimizer` | `resharding_exit_train` |

`timing/resharding_to_infer` is the enter + exit inference time and `timing/resharding_to_train` the enter +
exit training time, as MindSpeed-RL sums its sharding manager's transitions around generation and around the
update (services/coordinator/iteration_metrics.py). The weights are pushed after the rollout wakes (a sleeping
engine may hold no weights) and before the actor's parameters leave (the push reads them), as upstream does.

Each `Offload`/`Onload`/`Sleep`/`Wake` reply carries the service's resident set size; they are reported as
`memory/{actor,reference,rollout}/resident_bytes_*` so that the memory a sleeping service frees is visible.

`rl_config.share_backbone` (LoRA): there is no reference trainer (`reference` None here). The reference pass is
the actor's `ComputeLogProbs` with `adapters_off`, streamed during the rollout when disaggregated, and in
integrated mode run with the actor's parameters onloaded (as for the old log-probs) instead of a reference's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from rlfabric.v1 import rollout_pb2, trainer_pb2
from services.coordinator.errors import IterationError
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.weight_sync import Replica, WeightSync

T = TypeVar("T")


@dataclass(frozen=True)
class OffloadKeys:
    """What the actor gives up while the rollout runs (`generate_config.offload_train_*`)."""

    param: bool
    grad: bool
    optimizer: bool


class Placement:
    """The device-sharing transitions of a run (see module docstring); no-ops where a mode has none."""

    def __init__(self, integrated: bool, actor: Any, reference: Any | None, replicas: Sequence[Replica],
                 weight_sync: WeightSync, offload: OffloadKeys, deadline_s: float) -> None:
        self.integrated = integrated
        self.actor = actor
        self.reference = reference
        self.replicas = replicas if isinstance(replicas, list) else list(replicas)  # the run's ReplicaSet, shared
        self.weight_sync = weight_sync
        self.offload = offload
        self.deadline_s = deadline_s
        self.memory: dict[str, float] = {}  # this iteration's resident-set readings, see take_memory_metrics

    @property
    def streams_reference(self) -> bool:
        """Whether the reference computes while the rollout generates (only on devices of its own)."""
        return not self.integrated

    def prepare(self) -> None:
        """Before the run's first weight sync: the state every iteration starts from.

        Integrated: replicas awake (a sleeping engine may refuse weights), the actor's parameters in and its
        gradients and optimizer state out per the keys (where an update leaves them), the reference out.
        Idempotent, so a resumed run starts from the same state whatever the services were left in.
        """
        if not self.integrated:
            return
        for r in self.replicas:
            self._call(f"rollout {r.address} Wake", r.stub.Wake, rollout_pb2.WakeRequest())
        self._call("actor Onload", self.actor.Onload, trainer_pb2.OnloadRequest(params=True, grads=True,
                                                                               optimizer=True))
        self._call("actor Offload", self.actor.Offload, trainer_pb2.OffloadRequest(
            grads=self.offload.grad, optimizer=self.offload.optimizer))
        if self.reference is not None:
            self._call("reference Offload", self.reference.Offload, trainer_pb2.OffloadRequest(params=True))

    def enter_infer(self, clock: PhaseClock, version: int) -> None:
        """Before generating at `version`: wake the replicas, sync them, move the actor's parameters out."""
        if not self.integrated:
            return
        start = time.perf_counter()
        awake = [self._call(f"rollout {r.address} Wake", r.stub.Wake, rollout_pb2.WakeRequest())
                 for r in self.replicas]
        self.memory["memory/rollout/resident_bytes_awake"] = float(sum(a.resident_bytes for a in awake))
        if self.weight_sync.version != version:
            self._push(version)
        out = self._call("actor Offload", self.actor.Offload, trainer_pb2.OffloadRequest(params=self.offload.param))
        self.memory["memory/actor/resident_bytes_offloaded"] = float(out.resident_bytes)
        clock.record("resharding_enter_infer", start, time.perf_counter())

    def exit_infer(self, clock: PhaseClock) -> None:
        """After generating: the replicas sleep (free their KV cache, and on devices their weights)."""
        if not self.integrated:
            return
        start = time.perf_counter()
        asleep = [self._call(f"rollout {r.address} Sleep", r.stub.Sleep, rollout_pb2.SleepRequest(level=1))
                  for r in self.replicas]
        self.memory["memory/rollout/resident_bytes_asleep"] = float(sum(a.resident_bytes for a in asleep))
        clock.record("resharding_exit_infer", start, time.perf_counter())

    def reference_pass(self, clock: PhaseClock, forward: Callable[[], T]) -> T:
        """Runs `forward` (the reference's log-prob pass) with the reference's parameters onloaded around it; under
        share_backbone (no reference trainer: the actor's backbone) with the actor's parameters in."""
        if not self.integrated:
            return forward()
        if self.reference is None:
            self.enter_forward()
            return forward()
        start = time.perf_counter()
        on = self._call("reference Onload", self.reference.Onload, trainer_pb2.OnloadRequest(params=True))
        clock.record("ref_onload", start, time.perf_counter())
        self.memory["memory/reference/resident_bytes_onloaded"] = float(on.resident_bytes)
        out = forward()
        start = time.perf_counter()
        off = self._call("reference Offload", self.reference.Offload, trainer_pb2.OffloadRequest(params=True))
        clock.record("ref_offload", start, time.perf_counter())
        self.memory["memory/reference/resident_bytes_offloaded"] = float(off.resident_bytes)
        return out

    def enter_forward(self) -> None:
        """Before the actor's old-log-prob pass: its parameters back (MindSpeed-RL's enter_forward_mode)."""
        if self.integrated and self.offload.param:
            self._call("actor Onload", self.actor.Onload, trainer_pb2.OnloadRequest(params=True))

    def enter_train(self, clock: PhaseClock) -> None:
        if not self.integrated:
            return
        start = time.perf_counter()
        on = self._call("actor Onload", self.actor.Onload, trainer_pb2.OnloadRequest(
            params=self.offload.param, grads=self.offload.grad, optimizer=self.offload.optimizer))
        self.memory["memory/actor/resident_bytes_onloaded"] = float(on.resident_bytes)
        clock.record("resharding_enter_train", start, time.perf_counter())

    def exit_train(self, clock: PhaseClock) -> None:
        if not self.integrated:
            return
        start = time.perf_counter()
        self._call("actor Offload", self.actor.Offload, trainer_pb2.OffloadRequest(
            grads=self.offload.grad, optimizer=self.offload.optimizer))
        clock.record("resharding_exit_train", start, time.perf_counter())

    def after_update(self, clock: PhaseClock, new_version: int) -> None:
        """Disaggregated: push the updated weights now. Integrated: the next `enter_infer` pushes them."""
        if self.integrated:
            return
        start = time.perf_counter()
        self._push(new_version)
        clock.record("resharding_enter_infer", start, time.perf_counter())

    def _push(self, version: int) -> None:
        """Replicas that registered since the last push join first (awake, when integrated), then all get `version`.

        So a new or restarted replica holds the run's weights before any group is dealt to it.
        """
        refresh = getattr(self.replicas, "refresh", None)
        joined = refresh() if refresh is not None else []
        if self.integrated:
            for r in joined:
                self._call(f"rollout {r.address} Wake", r.stub.Wake, rollout_pb2.WakeRequest())
        self.weight_sync.push(version)

    def checkpoint(self, save: Callable[[], T]) -> T:
        """Runs `save` with the actor's optimizer state and parameters in (a checkpoint holds both)."""
        if not self.integrated:
            return save()
        self._call("actor Onload", self.actor.Onload, trainer_pb2.OnloadRequest(params=True, optimizer=True))
        try:
            return save()
        finally:
            self._call("actor Offload", self.actor.Offload, trainer_pb2.OffloadRequest(
                optimizer=self.offload.optimizer))

    def take_memory_metrics(self) -> dict[str, float]:
        out, self.memory = self.memory, {}
        return out

    def _call(self, what: str, method: Callable[..., T], request: Any) -> T:
        try:
            return method(request, timeout=self.deadline_s)
        except grpc.RpcError as e:
            raise IterationError(f"{what}: {e.code().name}: {e.details()}") from e
