"""The reference's (or any trainer's) log-prob pass streamed beside the rollout: samples go to the trainer's
`ComputeLogProbs` in micro-batches as they arrive, so that the pass overlaps generation (generation.py).
`KnownLogProbs` stands in for a stream whose log-probs were computed in earlier rollouts (partial rollout's)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rlfabric.v1 import common_pb2, trainer_pb2
from services.common.sequences import Sequences
from services.coordinator.errors import IterationError
from services.coordinator.generation import RequestStream
from services.coordinator.iteration_metrics import PhaseClock
from services.coordinator.settings import IterationSettings
from services.coordinator.trainer_requests import collect_log_probs, sequences_of


class LogProbStream:
    """Sends samples to a trainer's `ComputeLogProbs` in micro-batches as they come; log-probs by sample id.

    Under `rlfabric.deterministic` the micro-batches are cut in sample-id order once the last sample is in: which
    samples share a micro-batch (its padding, its packing) would otherwise follow the arrival order, and with it
    the last bits of their log-probs."""

    def __init__(self, name: str, stub: Any, settings: IterationSettings, micro_batch_size: int,
                 clock: PhaseClock, *, adapters_off: bool = False) -> None:
        # adapters_off: the actor's backbone without its LoRA adapters (share_backbone's reference pass).
        self._adapters_off = adapters_off
        self.log_probs: dict[str, np.ndarray] = {}
        self.arrival: dict[str, int] = {}  # sample id -> the order it came in (the order of its log-probs)
        self._replied = threading.Condition()
        self._lengths: dict[str, int] = {}
        self._pending: list[tuple[common_pb2.Sample, np.ndarray]] = []
        self._micro = micro_batch_size
        self._in_sample_order = settings.deterministic
        self._temperature = settings.temperature
        self._stream = RequestStream(name, lambda it: stub.ComputeLogProbs(it, timeout=settings.deadline_s),
                                     self._collect, clock)

    def _collect(self, reply: trainer_pb2.LogProbResponse) -> None:
        with self._replied:
            collect_log_probs(reply, self._lengths, self.log_probs)
            self._replied.notify_all()

    def wait_for(self, sample_ids: Sequence[str]) -> None:
        """Waits until the log-probs of `sample_ids` are in, or the stream has ended (then `join` says why)."""
        with self._replied:
            while not self._stream.ended and any(x not in self.log_probs for x in sample_ids):
                self._replied.wait(timeout=0.1)

    def add(self, sample: common_pb2.Sample, prompt: np.ndarray, weights_version: int) -> None:
        self._lengths[sample.sample_id] = sample.response_length
        self.arrival[sample.sample_id] = len(self.arrival)
        self._pending.append((sample, prompt))
        if len(self._pending) >= self._micro and not self._in_sample_order:
            self.flush(weights_version)

    def flush(self, weights_version: int) -> None:
        pending = sorted(self._pending, key=lambda p: p[0].sample_id) if self._in_sample_order else self._pending
        for start in range(0, len(pending), self._micro):
            samples, prompts = zip(*pending[start:start + self._micro], strict=True)
            seqs = sequences_of(samples, prompts, weights_version)
            self._stream.put(trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=self._temperature,
                                                        adapters_off=self._adapters_off))
        self._pending = []

    def close(self) -> None:
        self._stream.close()

    def join(self) -> dict[str, np.ndarray]:
        self._stream.join()
        return self.log_probs


class KnownLogProbs:
    """Log-probs already computed, with a stream's `close` and `join`: partial rollout's reference log-probs of a
    trained batch, streamed in the rollouts where each of its responses ended (partial_rollout.py)."""

    def __init__(self, log_probs: dict[str, np.ndarray]) -> None:
        self.log_probs = log_probs

    def close(self) -> None:
        pass

    def join(self) -> dict[str, np.ndarray]:
        return self.log_probs


def requests_as_log_probs_arrive(stream: LogProbStream, seqs: Sequences, chunk: int,
                                 request: Callable[[Sequences], trainer_pb2.UpdateRequest],
                                 failed: list[IterationError]) -> Iterator[trainer_pb2.UpdateRequest]:
    """The actor's Update requests over `seqs` in the order the reference's log-probs came, each one sent as soon as
    the log-probs of its `chunk` samples are in (a streaming update: services/trainer/streamed_update.py).

    A request that cannot be built (the reference failed) ends the requests there, its error in `failed`: an error
    raised inside a request iterator would reach the caller only as a cancelled call."""
    ordered = seqs.select(sorted(range(len(seqs)), key=lambda i: stream.arrival.get(seqs.sample_ids[i], len(seqs))))
    for start in range(0, len(ordered), chunk):
        part = ordered.take(start, start + chunk)
        stream.wait_for(part.sample_ids)
        try:
            yield request(part)
        except IterationError as e:
            failed.append(e)
            return
