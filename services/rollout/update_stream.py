"""One UpdateWeights stream applied to a rollout engine: buckets staged as they arrive, then the commit.

`UpdateStream` stages the buckets (weights.py `WeightStager`); updates are serialised per engine
(`RolloutEngine.update_lock`). gRPC buckets (bytes kept as views of the message) are queued on the engine
thread as they arrive, at most `_APPLIES_AHEAD` ahead of the stream, each checked as it is applied after saving
the values it overwrites, so the copy into the engine overlaps the transfer and only a few received messages are
alive at once (their memory is reused rather than faulted in afresh). A stream that fails before its commit
completes (refused bucket, bad checksum, cancelled, no commit) gets the backup restored before its error is
raised: the replica serves its previous weights bitwise, at its previous version; during the stream it refuses
`Generate` (the coordinator never generates on a replica it is pushing to). Shared-memory buckets are applied
the same way without a backup (a failed push leaves the replica refusing to generate until a complete one
lands). Buckets with their bytes inside the message (and collective buckets) are applied together at the
commit. No gRPC here: the servicer (server.py) answers each error with the status code it names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from rlfabric.v1 import rollout_pb2
from services.common.weight_version import AS_LOADED
from services.rollout.engine import RolloutEngine
from services.rollout.engine_thread import EngineUnavailableError
from services.rollout.weights import COLLECTIVE, StagedUpdate, WeightStager, WeightUpdateError

logger = logging.getLogger(__name__)

# Streamed buckets (gRPC, shared memory) queued on the engine ahead of the one being read: enough to keep the engine
# busy while the next message arrives, few enough that the received messages' memory is recycled.
_APPLIES_AHEAD = 2

_T = TypeVar("_T")


class WeightApplyError(WeightUpdateError):
    """The engine failed to apply a verified update; it refuses to serve until a complete update lands."""

    code = "INTERNAL"


class UpdateStream:
    """Stages and applies the chunks of one UpdateWeights call to `engine` (see module docstring)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.stager = WeightStager(engine.expected_weights, held_version=engine.weights_version)
        # Buckets whose bytes the servicer keeps out of the message (gRPC views, shared memory) are applied as
        # they arrive, under the engine's update lock for the rest of the stream; gRPC ones with a backup.
        self._streamed: str | None = None  # "shm" or "grpc" once the first bucket was handed to the engine
        self._pending: list[Future] = []  # streamed buckets queued on the engine thread, in order
        self._groups: set[str] = set()  # the collective groups this stream's buckets named

    def apply(self, chunks: Iterable[rollout_pb2.WeightUpdateChunk | Any]) -> StagedUpdate:
        """Returns the update applied; raises WeightUpdateError (its `code` names the status) or
        EngineUnavailableError, after restoring what the stream had applied (gRPC buckets)."""
        try:
            try:
                staged = self._receive(chunks)
                self._commit(staged)
            except BaseException:
                for group_id in self._groups:  # the sender drops the group of a failed push: left before answering
                    COLLECTIVE.leave(group_id)
                for future in self._pending:
                    future.exception()  # every queued piece has run (or failed) before the lock is released
                if self._streamed == "grpc":
                    self._restore()  # before the caller hears of the failure
                raise
        finally:
            if self._streamed:
                self.engine.update_lock.release()
        return staged

    def _receive(self, chunks: Iterable[rollout_pb2.WeightUpdateChunk | Any]) -> StagedUpdate:
        """Stages (and, streamed, applies) every bucket up to the commit; returns what the commit verified."""
        for chunk in chunks:
            kind = chunk.WhichOneof("kind")
            if kind == "bucket":
                self._add_bucket(chunk)
            elif kind == "commit":
                # The engine first finishes the buckets it holds: their checks are its own (shared memory), and
                # those it has not claimed would otherwise be read here a second time.
                self._settle(0)
                return self.stager.commit(chunk.commit)
            else:
                raise WeightUpdateError("a WeightUpdateChunk must carry a bucket or a commit")
        raise WeightUpdateError("the stream ended without a WeightCommit: nothing was applied")

    def _add_bucket(self, chunk: rollout_pb2.WeightUpdateChunk | Any) -> None:
        bucket = chunk.bucket
        if bucket.HasField("collective"):
            self._groups.add(bucket.collective.group_id)
        if bucket.version == AS_LOADED:
            raise WeightUpdateError(f"bucket.version must be above {AS_LOADED} (the version of the weights as loaded "
                                    "from disk)")
        data = getattr(chunk, "data", None)
        self.stager.add_bucket(bucket, data)
        mode = "shm" if bucket.HasField("shm") else "grpc" if data is not None else None
        if mode is None:
            return  # bytes inside the message or a collective's: applied at the commit
        if self._streamed is None:
            self.engine.update_lock.acquire()
        elif mode != self._streamed:
            raise WeightUpdateError("a stream carries shared-memory buckets or gRPC buckets, not both")
        first, self._streamed = self._streamed is None, mode
        taken = self.stager.take(bucket.index)
        self._pending.append(self._applied(lambda: self.engine.update_weights_async(
            taken, first=first, last=False, backup=mode == "grpc")))
        self._settle(_APPLIES_AHEAD)

    def _commit(self, staged: StagedUpdate) -> None:
        engine = self.engine
        if self._streamed:
            # Tensors left for the commit (bytes inside their message) get the backup too.
            backup = self._streamed == "grpc"
            self._applied(lambda: engine.update_weights(staged, first=False, last=True, backup=backup))
        else:
            with engine.update_lock:
                self._applied(lambda: engine.update_weights(staged, first=True, last=True))

    def _settle(self, ahead: int) -> None:
        """Waits for queued bucket applies until at most `ahead` remain (raising the first failure): the
        received messages they hold stay few, so their memory is reused rather than faulted in afresh."""
        while len(self._pending) > ahead:
            self._applied(self._pending[0].result)
            self._pending.pop(0)

    def _restore(self) -> None:
        try:
            self.engine.restore_weights()
        except Exception:  # the engine closed meanwhile: it serves nothing
            logger.exception("restoring the weights after a failed update failed")

    @staticmethod
    def _applied(apply: Callable[[], _T]) -> _T:
        """`apply()`, with a failure other than a refusal or an unavailable engine as WeightApplyError."""
        try:
            return apply()
        except (EngineUnavailableError, WeightUpdateError):
            raise
        except Exception as e:  # reported to the caller; the engine refuses to serve
            raise WeightApplyError(f"applying the weight update failed: {e}") from e
