"""The checks of a weight update's bytes on the replica (services/rollout/weights.py).

Each tensor gets its checksum (services/common/checksum.py) and a finiteness check in one pass over its bytes
(natively both at once; otherwise an int64 and a float sum per cache-sized step, a non-finite float sum
sending to the exact check), and a cast when its dtype is not the engine's; then the bucket checksum is
compared with the sent one. A streamed bucket (bytes kept out of the message, or in shared memory) is
checked by the engine as it applies it (`Verified`): a tensor whose place in the parameters the engine
knows is copied there with the checks riding along (`Verification.place`: one read of the bytes for
checks and copy); any other is checked, then handed to vLLM's loader while its bytes are in cache. So a
checked tensor that fails has landed in a streamed apply, which then fails midway (undone from the gRPC
backup, or refused until a complete update for shared memory), and the bucket's checksum covers every tensor
the engine took. Other buckets are checked whole before the engine sees any tensor. The error classes carry
the status-code name the servicer answers with.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from services.common.checksum import chain, copy_word_sum_and_finite, fold, word_sum_and_finite


class WeightUpdateError(Exception):
    """A rejected update; `code` is the gRPC status name to answer with (what a streamed update applied
    before is restored or fenced by the servicer)."""

    code = "INVALID_ARGUMENT"


class WeightDataLossError(WeightUpdateError):
    """Bytes were corrupted or a bucket is missing."""

    code = "DATA_LOSS"


class WeightSegmentError(WeightUpdateError):
    """A shared-memory bucket whose segment this replica cannot map (another host, or /dev/shm not shared)."""

    code = "FAILED_PRECONDITION"


class WeightsVersionBehindError(WeightUpdateError):
    """The update is for a version below the one served: versions only move forward."""

    code = "FAILED_PRECONDITION"

    def __init__(self, version: int, held: int) -> None:
        super().__init__(f"version {version} is below the version this replica serves ({held}): weights versions "
                         "only move forward; push a newer version")


@dataclass(frozen=True)
class ParamSpec:
    """What the engine expects for one HF-named tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _checksum_and_finite(tensor: torch.Tensor) -> tuple[int, bool]:
    """The tensor's checksum (services/common/checksum.py) and whether every value is surely finite (False:
    the caller checks exactly), in one pass over memory."""
    total, finite = word_sum_and_finite(tensor)
    return fold(total, tensor.numel() * tensor.element_size()), finite


def _copy_checksum_and_finite(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, bool]:
    """`_checksum_and_finite` of the bytes of `src` as they land in `dst` (contiguous, same dtype and size):
    the checks ride along with the copy instead of reading the tensor from memory once more before it."""
    total, finite = copy_word_sum_and_finite(dst, src)
    return fold(total, dst.numel() * dst.element_size()), finite


class Verification:
    """The checks of one bucket's bytes: each tensor's checksum and finiteness (and a cast to the engine's
    dtype), then the bucket checksum. Tensors are claimed in order by whoever works on the bucket: `run` (the
    caller's thread) claims all that are left; `tensor(i)` and `place(i)`, the engine's side of a streamed
    apply (`take`, `Verified`), claim one at a time as the engine reaches it. `result` waits for all of
    them. A checksum mismatch wins over a bad value, and the first bad tensor in order is the one reported:
    after a non-finite tensor the others are still summed."""

    def __init__(self, index: int, version: int, sent: int, views: list[tuple[str, torch.Tensor]],
                 expected: Mapping[str, ParamSpec]) -> None:
        self.index, self.version, self.sent = index, version, sent
        self._views, self._expected = views, expected
        self._shapes = [(name, tuple(t.shape)) for name, t in views]
        self._out: list[tuple[str, torch.Tensor] | None] = [None] * len(views)
        self._sums: list[int] = [0] * len(views)
        self._bad: list[BaseException | None] = [None] * len(views)
        self._ready = [threading.Event() for _ in views]
        self._lock = threading.Lock()
        self._next = 0  # the first tensor nobody has claimed
        self._checked = 0
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._taken = False
        if not views:
            self._finish()

    def run(self) -> None:
        """Checks every tensor nobody has claimed yet (the others are being checked elsewhere)."""
        while (i := self._claim()) is not None:
            self._check(i)

    def _claim(self) -> int | None:
        with self._lock:
            if self._next >= len(self._ready):
                return None
            self._next += 1
            return self._next - 1

    def _check(self, i: int, into: torch.Tensor | None = None) -> None:
        name, tensor = self._views[i]
        try:
            if into is None:
                checksum, finite = _checksum_and_finite(tensor)
                self._sums[i] = checksum
                self._out[i] = (name, self._checked_tensor(name, tensor, finite))
            else:  # copied in place while checked (`place`): nothing is handed over
                checksum, finite = _copy_checksum_and_finite(into, tensor)
                self._sums[i] = checksum
                if not finite:
                    _require_finite(into, f"bucket {self.index}: parameter {name!r}", applied=True)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for this bucket
            self._bad[i] = e  # a bad value's bytes were summed all the same: the checksum still decides first
        with self._lock:
            self._checked += 1
            last = self._checked == len(self._ready)
        if last:
            self._finish()
        else:
            self._ready[i].set()

    def _finish(self) -> None:
        actual = chain(self._sums)
        bad = next((e for e in self._bad if e is not None), None)
        if bad is not None and not isinstance(bad, WeightUpdateError):
            self._error = bad  # the checks themselves failed: no checksum to compare
        elif actual != self.sent:
            self._error = WeightDataLossError(f"bucket {self.index} of version {self.version}: checksum "
                                              f"{actual:#010x} != sent {self.sent:#010x}; resend the update")
        else:
            self._error = bad
        self._views = []
        self._done.set()
        for ready in self._ready:
            ready.set()

    def _checked_tensor(self, name: str, tensor: torch.Tensor, finite: bool) -> torch.Tensor:
        where = f"bucket {self.index}: parameter {name!r}"
        if not finite:
            _require_finite(tensor, where)
        spec = self._expected[name]
        if tensor.dtype != spec.dtype:  # the only copy before the engine's own: a cast
            tensor = tensor.to(spec.dtype)
            _require_finite(tensor, where)
        return tensor

    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self._shapes

    def result(self) -> list[tuple[str, torch.Tensor]]:
        """The verified tensors (none once taken); raises the bucket's failure."""
        self.run()  # what nobody has claimed yet is checked here rather than waited for
        self._done.wait()
        if self._error is not None:
            raise self._error
        return [] if self._taken else [t for t in self._out if t is not None]

    def take(self) -> Verified:
        taken = Verified(self) if not self._taken else Verified(None)
        self._taken = True
        return taken

    def place(self, i: int, into: torch.Tensor) -> bool:
        """Copies tensor i (called in order) into `into` while checking it, when nobody has claimed it yet and
        `into` (a contiguous view of the engine's parameter) has its dtype and size: one pass over the bytes
        for both the checks and the engine's copy. False: not placed, take it with `tensor(i)`. A tensor that
        fails its checks has already landed (the caller's update fails midway: restored from its backup, or
        refused until a complete update lands); its failure is raised once every tensor was summed."""
        with self._lock:
            if self._next != i:
                return False
            name, tensor = self._views[i]
            if (tensor.dtype != into.dtype or tensor.dtype != self._expected[name].dtype
                    or tensor.numel() != into.numel() or not into.is_contiguous()):
                return False
            self._next += 1
        self._check(i, into)
        if self._bad[i] is not None:
            self.result()
            raise AssertionError("a failed tensor always fails its bucket")
        return True

    def tensor(self, i: int) -> tuple[str, torch.Tensor]:
        """Tensor i once it passed (called in order); checks it here if nobody has claimed it yet."""
        with self._lock:
            mine = self._next == i
            if mine:
                self._next += 1
        if mine:
            self._check(i)
        self._ready[i].wait()
        item = self._out[i]
        if item is None:
            self.result()  # raises the failure (a bad value once every tensor was summed)
            raise AssertionError("a tensor without a failure is never missing")
        self._out[i] = None  # handed over: the bucket keeps no reference
        return item


class Verified:
    """The tensors of a taken bucket, each yielded once it passed its checks (see `Verification`); iterated
    once, in order (the engine's `load_weights` takes an iterator)."""

    def __init__(self, pending: Verification | None) -> None:
        self._pending = pending
        self._n = len(pending._out) if pending else 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            for i in range(self._n):
                yield pending.tensor(i)
            pending.result()  # a checksum mismatch surfaces after the last tensor

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._pending.shapes()] if self._pending is not None else []

    def placing(self, destinations: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Iterates like the bucket itself, except that each tensor with a view of the engine's parameter in
        `destinations` is copied there while it is checked (`Verification.place`) and not yielded."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        names = [name for name, _ in pending.shapes()]
        for i in range(self._n):
            into = destinations.get(names[i])
            if into is None or not pending.place(i, into):
                yield pending.tensor(i)
        pending.result()

    def __reduce__(self):
        # Executors in other processes get the plain list (pickling waits for the checks).
        return list, (list(iter(self)),)


def _require_finite(tensor: torch.Tensor, where: str, applied: bool = False) -> None:
    """Refuses NaN / inf values (see module docstring for why a sum); `applied`: they already landed in the
    engine's parameter (`Verification.place`)."""
    if math.isfinite(float(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32))):
        return
    bad = (~torch.isfinite(tensor)).reshape(-1).nonzero()
    if len(bad) == 0:
        return  # finite values whose float32 sum overflowed
    first = int(bad[0])
    raise WeightUpdateError(f"{where} has {len(bad)} non-finite values (the first, {tensor.reshape(-1)[first].item()}, "
                            f"at flat index {first})" + ("" if applied else "; nothing was applied"))
