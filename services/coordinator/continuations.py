"""Multi-turn continuations during generation: each turn's next step, and the continuation out to a replica.

With `rl_config.multi_turn_enable`, every sample the Generator (generation.py) receives is one turn of a
trajectory. Its next step (multi_turn.py `MultiTurn.next_step`: parse the calls, answer them) runs on a thread of
its own, since tool calls block; the continuation then goes to the replicas in turn as a one-sample group
`{sample_id}@{turn}` whose prompt is the whole context so far, at the batch's expected weights version. A
trajectory that made its last turn goes back to the Generator's receiving loop as `Finished`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.tensors import to_proto
from services.coordinator.errors import IterationError
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.multi_turn import MultiTurn, Trajectory
from services.coordinator.weight_sync import Replica

if TYPE_CHECKING:
    from services.coordinator.generation import GroupPrompt

# Sends requests to the given replicas, streaming the samples to the queue (Generator._deal).
Deal = Callable[[list[rollout_pb2.GenerateRequest], list[Replica], PhaseClock, queue.Queue], None]


@dataclass
class Finished:
    """A multi-turn trajectory that made its last turn (multi_turn.py), for the receiving loop."""

    trajectory: Trajectory


def with_max_tokens(sampling: common_pb2.SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    """A copy of `sampling` with its own `max_tokens`."""
    own = common_pb2.SamplingParams()
    own.CopyFrom(sampling)
    own.max_tokens = max_tokens
    return own


class Continuations:
    """The trajectories of one generation call, turn by turn (see module docstring).

    Args:
        multi_turn: the turn logic.
        replicas: the run's replicas (the ReplicaSet itself: a lost replica leaves it).
        deal: sends requests to replicas (Generator._deal: failover included).
        count_duplicate: called for a turn that arrived twice (a re-sent group's second copy).
    """

    def __init__(self, multi_turn: MultiTurn, replicas: list[Replica], deal: Deal,
                 count_duplicate: Callable[[], None]) -> None:
        self.multi_turn = multi_turn
        self._replicas = replicas
        self._deal = deal
        self._count_duplicate = count_duplicate
        self._lock = threading.Lock()
        self._next_replica = 0
        self.start(common_pb2.SamplingParams())

    def start(self, sampling: common_pb2.SamplingParams) -> None:
        """A new generation call, whose continuations sample with `sampling` (each within its trajectory's room)."""
        self._sampling = sampling
        self._continuing: dict[str, Trajectory] = {}  # continuation group id -> its trajectory
        self._turns_seen: set[str] = set()

    def on_turn(self, item: common_pb2.Sample, by_group: Mapping[str, GroupPrompt], version: int,
                clock: PhaseClock, out: queue.Queue) -> None:
        """A turn arrived: its trajectory's next step runs on its own thread."""
        with self._lock:
            if item.sample_id in self._turns_seen:  # a re-sent group's second copy
                self._count_duplicate()
                return
            self._turns_seen.add(item.sample_id)
            trajectory = self._continuing.pop(item.group_id, None)
        if trajectory is None:
            trajectory = Trajectory(first=item, prompt=np.asarray(by_group[item.group_id].prompt, np.int32))
        threading.Thread(target=self._advance, args=(trajectory, item, version, clock, out),
                         name=f"turn-{item.sample_id}", daemon=True).start()

    def _advance(self, trajectory: Trajectory, item: common_pb2.Sample, version: int, clock: PhaseClock,
                 out: queue.Queue) -> None:
        try:
            context = self.multi_turn.next_step(trajectory, item)
        except Exception as e:  # noqa: BLE001 - the iteration fails naming the sample, never a silent hang
            out.put(IterationError(f"multi-turn: sample {trajectory.first.sample_id}: {type(e).__name__}: {e}"))
            return
        if context is None:
            out.put(Finished(trajectory))
            return
        group_id = f"{trajectory.first.sample_id}@{trajectory.turns}"
        sampling = with_max_tokens(self._sampling, min(self._sampling.max_tokens,
                                                       self.multi_turn.remaining_tokens(trajectory)))
        request = rollout_pb2.GenerateRequest(
            group=common_pb2.PromptGroup(group_id=group_id, prompt_token_ids=to_proto(context), n=1),
            expected_weights_version=version, sampling=sampling)
        with self._lock:
            self._continuing[group_id] = trajectory
            replicas = list(self._replicas)
            self._next_replica += 1
        if not replicas:
            out.put(IterationError("no rollout replica left for a multi-turn continuation"))
            return
        self._deal([request], [replicas[self._next_replica % len(replicas)]], clock, out)
