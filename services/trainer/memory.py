"""Per-rank training memory: what the parameters, gradients, optimizer and activations of one rank hold.

Two sources, one set of numbers (docs/memory.md):

- **Own accounting** (every platform). `state_bytes(model, optimizer)` sums the bytes of the tensors the model
  and the optimizer reference, by storage: a storage is counted once however many tensors view it (a
  contiguous grad buffer with per-parameter `main_grad` views, tied weights), and in the first category that
  claims it, in the order parameters, gradients (`.grad` and Megatron's fp32 `.main_grad`, of the model's and
  of the optimizer's own parameters), master weights (parameters the optimizer steps that are not the model's,
  e.g. fp32 copies of bf16 weights), optimizer state (every tensor in `optimizer.state`, `step` included).
  `ActivationTracker` measures activation memory: the bytes autograd keeps for backward (below).
- **The device allocator** (CUDA, Ascend): `DevicePeak` reads `max_memory_allocated` over the update, which
  also sees what accounting cannot (temporaries, allocator fragmentation of live blocks, communication
  buffers). On CPU there is no allocator to ask, and the peak is the accounting's sum.

Activation accounting (`ActivationTracker`): a `torch.autograd.graph.saved_tensors_hooks` pair sees every tensor
the forward saves for backward (Megatron's custom autograd functions included, and the recomputed forward of
activation checkpointing, which runs inside backward). Each saved tensor is wrapped in a small handle that
autograd holds in place of the tensor; the handle counts its storage in while it lives and out when autograd
drops it, which happens when backward has consumed that node (or the graph is freed unused). So the running
total is exactly the bytes the graph keeps alive:
- counted once per storage (a tensor saved by two nodes, or views of one buffer, count their storage once;
  a view counts its whole storage, since that is what stays allocated);
- parameters (and views of them, such as a transposed weight) are not activations and are skipped;
- the peak is the high-water mark of forward, and of the recomputation that full or selective recompute
  runs during backward; a storage freed while saved (resized to nothing) stops counting;
- it does not see temporaries that are freed before backward (an op's scratch, a softmax's input that is
  not saved) nor tensors hidden behind another saved-tensors hook (torch's non-reentrant checkpoint installs
  its own, which takes precedence inside its region; Megatron's recompute is reentrant and is seen).

`UpdateMemory` puts the three together for one `grpo_update` and turns them into the `memory/{role}/*`
metrics (the largest value over the group's ranks, since the most loaded rank is the one that runs out).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from services.common.accelerator import npu_present
from services.planning.arithmetic import StateBytes

# Metric names under `memory/{role}/` (docs/memory.md).
PARAMS = "params_bytes"
GRADS = "grads_bytes"
OPTIMIZER = "optimizer_bytes"  # master weights + optimizer state
ACTIVATIONS_PEAK = "activations_peak_bytes"
PEAK = "peak_bytes"
METRIC_NAMES = (PARAMS, GRADS, OPTIMIZER, ACTIVATIONS_PEAK, PEAK)


def _storage_key(t: torch.Tensor) -> tuple[int, int, torch.UntypedStorage] | None:
    """(identity, bytes, storage) of `t`'s storage; None for tensors without one (sparse, meta, empty).

    The identity is the storage object's own (`_cdata`, its C++ StorageImpl), not its data address: a saved
    storage can release its memory while saved (Megatron's CheckpointWithoutOutput resizes it to nothing,
    pipeline schedules swap `.data`), and the next tensor allocated there is another storage.
    """
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    n = s.nbytes()
    if n == 0 or t.device.type == "meta":
        return None
    return s._cdata, n, s


class _Claims:
    """Storages already counted, so each is counted once and in the first category that sees it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def take(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None or key[0] in self.seen:
                continue
            self.seen.add(key[0])
            total += key[1]
        return total


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The `torch.optim.Optimizer` inside Megatron-style wrappers (`.optimizer` chains), or None."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def state_bytes(model: torch.nn.Module, optimizer: Any = None) -> StateBytes:
    """This rank's bytes of parameters, gradients, master weights and optimizer state.

    An optimizer that knows its own layout (a `memory_bytes()` method returning a mapping with any of the keys
    `params`, `grads`, `master`, `optimizer_states`) is asked instead of being walked; the model's parameters
    and gradients are still counted here when it leaves them out.
    """
    own = getattr(optimizer, "memory_bytes", None)
    if callable(own):
        reported: Mapping[str, int] = own()
        base = state_bytes(model, None)
        return StateBytes(params=int(reported.get("params", base.params)),
                          grads=int(reported.get("grads", base.grads)),
                          master=int(reported.get("master", 0)),
                          optimizer_states=int(reported.get("optimizer_states", 0)))
    claims = _Claims()
    model_params = list(model.parameters())
    params = claims.take(model_params)
    inner = torch_optimizer(optimizer)
    opt_params = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
    grads = claims.take(g for p in [*model_params, *opt_params] for g in (p.grad, getattr(p, "main_grad", None)))
    master = claims.take(opt_params)
    states = 0
    if inner is not None:
        states = claims.take(v for st in inner.state.values() for v in _tensors(st))
    return StateBytes(params=params, grads=grads, master=master, optimizer_states=states)


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class ActivationTracker:
    """Context manager: the live and peak bytes autograd saves for backward while it is active.

        with ActivationTracker(model) as act:
            loss = model(x).sum()
            loss.backward()
        act.peak_bytes, act.current_bytes   # current is 0 again once backward has run

    `model`: its parameters (and views of them) are not counted. Without a model, leaf tensors that require
    grad (parameters of any module) are skipped instead. Thread-safe: backward may run on the engine's
    device threads, which inherit the hooks.

    A saved storage can shrink while saved (Megatron's CheckpointWithoutOutput frees its output with
    resize_(0) and refills it in backward). The running total counts storages at their size when saved, so a
    new high is only a candidate; it is settled against the storages' live sizes at the next release (the
    end of the rise) or when read: one pass over what is saved per high, not one per saved tensor.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._exclude = {k[0] for p in model.parameters() if (k := _storage_key(p))} if model is not None else None
        self._live: dict[int, _Entry] = {}  # storage identity -> entry
        self._lock = threading.Lock()
        self._current = 0  # by the sizes last seen
        self._peak = 0  # settled
        self._candidate = False  # _current rose above _peak since the last settle
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> ActivationTracker:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def current_bytes(self) -> int:
        with self._lock:
            self._recount()
            return self._current

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            self._settle()
            return self._peak

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is live now."""
        with self._lock:
            self._recount()
            self._peak, self._candidate = self._current, False

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is None:
            return t
        addr, nbytes, storage = key
        if self._exclude is not None:
            if addr in self._exclude:
                return t
        elif t.is_leaf and t.requires_grad:
            return t
        with self._lock:
            entry = self._live.get(addr)
            if entry is not None:
                entry.handles += 1
            else:
                self._live[addr] = _Entry(storage, nbytes)
                self._current += nbytes
                self._candidate = self._candidate or self._current > self._peak
        return _Saved(t, addr, self)

    def _recount(self) -> None:
        total = 0
        for entry in self._live.values():
            entry.nbytes = entry.storage.nbytes()
            total += entry.nbytes
        self._current = total

    def _settle(self) -> None:
        if self._candidate:
            self._recount()
            self._peak, self._candidate = max(self._peak, self._current), False

    def _release(self, addr: int) -> None:
        with self._lock:
            entry = self._live.get(addr)
            if entry is None:
                return
            entry.handles -= 1
            if entry.handles == 0:
                self._settle()  # the total is about to fall: a candidate high is settled first
                del self._live[addr]
                self._current -= entry.nbytes


class _Entry:
    __slots__ = ("storage", "nbytes", "handles")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.storage, self.nbytes, self.handles = storage, nbytes, 1


class _Saved:
    """What autograd holds instead of a saved tensor; counts its storage out when autograd drops it."""

    __slots__ = ("tensor", "addr", "tracker")

    def __init__(self, tensor: torch.Tensor, addr: int, tracker: ActivationTracker) -> None:
        self.tensor, self.addr, self.tracker = tensor, addr, tracker

    def __del__(self) -> None:
        self.tracker._release(self.addr)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


class DevicePeak:
    """Context manager: the device allocator's peak allocated bytes while active; `peak_bytes` is None on CPU."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._mod = _device_module()

    def __enter__(self) -> DevicePeak:
        if self._mod is not None:
            self._mod.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mod is not None:
            self.peak_bytes = int(self._mod.max_memory_allocated())


def _device_module() -> Any:
    """torch.cuda or torch.npu (torch_npu) when its device is in use, else None."""
    if torch.cuda.is_available():
        return torch.cuda
    return torch.npu if npu_present() else None  # torch.npu: registered by torch_npu


def _collective_device() -> torch.device:
    """Where the default process group reduces: host memory for gloo, the current device for NCCL / HCCL."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("npu", torch.npu.current_device())  # HCCL: only where torch_npu is loaded


class UpdateMemory:
    """The memory of one update on this rank, as `memory/{role}/*` metrics (module docstring).

        with UpdateMemory(model, optimizer) as mem:
            metrics = grpo_update(...)
        metrics.update(mem.metrics("actor"))   # a collective: every rank of the group calls it
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.activations = ActivationTracker(model)
        self.device = DevicePeak()

    def __enter__(self) -> UpdateMemory:
        self.device.__enter__()
        self.activations.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.activations.__exit__(*exc)
        self.device.__exit__(*exc)

    def values(self) -> dict[str, float]:
        """This rank's values (no communication); measured after the update, while its gradients exist."""
        state = state_bytes(self.model, self.optimizer)
        act = self.activations.peak_bytes
        peak = self.device.peak_bytes if self.device.peak_bytes is not None else state.total + act
        return {PARAMS: state.params, GRADS: state.grads, OPTIMIZER: state.optimizer, ACTIVATIONS_PEAK: act,
                PEAK: peak}

    def metrics(self, role: str) -> dict[str, float]:
        """`memory/{role}/*`: each value the largest over the ranks of the default process group."""
        vals = self.values()
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([float(vals[k]) for k in METRIC_NAMES], dtype=torch.float64,
                             device=_collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            vals = dict(zip(METRIC_NAMES, t.cpu().tolist(), strict=True))
        return {f"memory/{role}/{k}": float(v) for k, v in vals.items()}
