"""The weights a rollout engine serves: their version, whether they may serve, and how an update is applied.

`ServedWeights` applies verified updates (weights.py `StagedUpdate`) to the vLLM engine, on the engine thread
(engine.py) between two steps:
- An update aborts the samples in flight (they would otherwise mix two versions); they come back with finish
  reason "abort". The prefix cache is reset after every update.
- A streamed update comes in pieces, during which the engine refuses to generate. Pieces applied with `backup`
  (gRPC buckets) first copy the vLLM parameters they write into (the whole fused qkv / gate_up parameter, host
  buffers reused across pushes: one model's worth of host memory; worker_ops.py `_Backup`), and `restore` puts
  them back when the push fails, so the engine again serves its previous weights and version, bitwise.
- An update never takes the served version backwards (checked here, where updates are applied, because
  several servicers may share one engine).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from services.common.weight_version import moves_forward
from services.rollout import metrics, worker_ops
from services.rollout.engine_thread import EngineUnavailableError
from services.rollout.weights import StagedUpdate, WeightsVersionBehindError, WeightUpdateError

logger = logging.getLogger(__name__)


class ServedWeights:
    """The served version and the refusal to generate (`error`) of one vLLM engine; used on its thread only.

    Args:
        engine: vLLM's `LLMEngine`.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.version = 0
        # Why the weights cannot serve (an update midway, a level-2 sleep), or None.
        self.error: str | None = None
        # While a push applies pieces with a backup: the refusal to generate from before it (see `restore`).
        self._before_push: tuple[str | None] | None = None

    def apply(self, update: StagedUpdate, first: bool, last: bool, backup: bool, *, asleep: bool,
              abort_in_flight: Callable[[str], None]) -> float:
        """Applies one piece (`first` to `last`) of an update; returns the seconds taken. `asleep`: vLLM's
        sleep mode holds the device weights; `abort_in_flight(reason)` ends the samples being generated."""
        started = time.monotonic()
        if first:
            if backup:
                # What `restore` returns to, set before any check: pieces queued behind a refused first one are
                # still applied (with their backup), then undone.
                self._before_push = (self.error,)
            if asleep:
                # vLLM's sleep mode has moved or discarded the device weights; writing them now would be lost.
                raise EngineUnavailableError("the replica is asleep; call Wake before UpdateWeights")
            if not moves_forward(update.version, self.version):
                raise WeightsVersionBehindError(update.version, self.version)
            abort_in_flight(f"weights changed from version {self.version} to {update.version} during generation; "
                            "regenerate at the new version")
        self._load(update, first, backup)
        if not last:
            self.error = (f"the weight update to version {update.version} did not complete; the weights "
                          "are inconsistent until a complete UpdateWeights succeeds")
            return time.monotonic() - started
        if self._before_push is not None:
            self._engine.apply_model(worker_ops.drop_backup)
            self._before_push = None
        # Cached prefixes were computed with the old weights.
        self._engine.reset_prefix_cache()
        self.version = update.version
        self.error = None
        seconds = time.monotonic() - started
        metrics.WEIGHTS_VERSION.set(update.version)
        metrics.WEIGHT_UPDATE_SECONDS.observe(seconds)
        logger.info("weights version %d applied: %d tensors, %d bytes in %.3f s", update.version,
                    update.num_tensors or len(update.tensors), update.num_bytes, seconds)
        return seconds

    def _load(self, update: StagedUpdate, first: bool, backup: bool) -> None:
        try:
            if update.tensors and backup:
                self._engine.apply_model(functools.partial(worker_ops.load_weights_with_backup, update.names,
                                                           update.tensors, first=first))
            elif update.tensors:
                self._engine.apply_model(functools.partial(worker_ops.load_weights, update.tensors, first=first))
        except Exception as e:
            # Some tensors may have been written: refuse to serve until a complete update lands.
            self.error = (f"the weight update to version {update.version} failed midway ({e}); "
                          "the weights are inconsistent until a complete UpdateWeights succeeds")
            if isinstance(e, WeightUpdateError):  # a bucket refused by its checks: the caller hears why
                logger.info("weight update to version %d refused while applying: %s", update.version, e)
            else:
                logger.exception("weight update to version %d failed", update.version)
            raise

    def restore(self) -> int:
        """Undoes the pieces applied with `backup` since the last complete update (see module docstring);
        returns the parameters restored."""
        if self._before_push is None:
            return 0  # no piece was applied with a backup (or the push completed)
        restored = self._engine.apply_model(worker_ops.restore_backup)
        restored = sum(restored) if isinstance(restored, list) else restored
        # Nothing generated since the push began (it refused to), so the prefix cache still matches these weights.
        (self.error,), self._before_push = self._before_push, None
        logger.info("weight update failed midway: restored %d parameters, still serving version %d", restored,
                    self.version)
        return restored
