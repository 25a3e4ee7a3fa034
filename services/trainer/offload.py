"""Offload and onload of one trainer rank's state (`Trainer.Offload` / `Trainer.Onload`).

Integrated mode (`rl_config.use_integrated_worker`) runs the actor, the reference and the rollout engine on the
same devices; the coordinator has each one give up its memory while another runs, and the
`generate_config.offload_train_param / _grad / _optimizer` keys say what the actor gives up. Three kinds:
`params` (the model's weights), `grads` (their `.grad`, or the trainer optimizer's main-grad buffer) and
`optimizer` (Adam's moments and the fp32 master weights; step counters stay).

Where the state goes:
- on an accelerator, to host memory and back (what frees device memory for the rollout engine);
- on a CPU-only host, the device is host memory, so a move "to host" would free nothing. There each tensor is
  written to an anonymous temporary file (unlinked at creation: it disappears with the process) and its memory
  is freed and handed back to the operating system (`services/common/memory.py`); onload reads it back. The
  process's resident set really shrinks and grows again, so integrated mode on one CPU machine does what it
  does on devices, and can be measured.

While a kind is offloaded the operations that need it refuse to run (`OffloadedError`, FAILED_PRECONDITION on the
wire) rather than compute on absent tensors. Offload and onload are idempotent per kind.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from services.common.memory import release_free_memory

KINDS = ("params", "grads", "optimizer")


class OffloadedError(RuntimeError):
    """An operation needs state that is offloaded; call Onload first."""


@dataclass
class _Slot:
    """One offloaded tensor: how to put it back, and where it went."""

    restore: Callable[[torch.Tensor], None]
    host: torch.Tensor | None = None  # accelerator: the host copy
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    nbytes: int = 0  # CPU: its bytes in the spill file, in slot order


@dataclass
class _Offload:
    slots: list[_Slot] = field(default_factory=list)
    spill: IO[bytes] | None = None


class StateOffloader:
    """Offloads and onloads the state of `model` (and `optimizer`), training on `device`."""

    def __init__(self, model: Any, optimizer: Any, device: torch.device) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self._offloaded: dict[str, _Offload] = {}

    def is_offloaded(self, kind: str) -> bool:
        return kind in self._offloaded

    def require(self, *kinds: str, what: str) -> None:
        """Raises `OffloadedError` when any of `kinds` is offloaded."""
        missing = [k for k in kinds if k in self._offloaded]
        if missing:
            raise OffloadedError(f"{what} needs the {' and '.join(missing)} that Offload moved out; call Onload first")

    def offload(self, kinds: Iterable[str]) -> int:
        """Moves each kind out (see module docstring); returns the bytes moved."""
        moved = 0
        for kind in _checked(kinds):
            if kind in self._offloaded:
                continue
            record = _Offload()
            for tensor, restore in self._tensors(kind):
                moved += self._move_out(record, tensor, restore, vacant=None if kind == "grads" else torch.empty(
                    0, dtype=tensor.dtype, device=tensor.device))
            self._offloaded[kind] = record
        if self.device.type == "cpu":
            release_free_memory()
        else:
            _empty_device_cache(self.device)
        return moved

    def onload(self, kinds: Iterable[str]) -> int:
        """Brings each offloaded kind back; returns the bytes moved."""
        moved = 0
        for kind in _checked(kinds):
            record = self._offloaded.pop(kind, None)
            if record is None:
                continue
            if record.spill is not None:
                record.spill.seek(0)
            for slot in record.slots:
                moved += self._move_in(record, slot)
            if record.spill is not None:
                record.spill.close()
        return moved

    # ---- per kind ---------------------------------------------------------------------------------
    def _tensors(self, kind: str) -> list[tuple[torch.Tensor, Callable[[torch.Tensor | None], None]]]:
        """(tensor, setter) of every tensor of `kind`.

        A parameter keeps its identity (the optimizer's state and tied weights refer to the object) and only
        its data is swapped; a grad cannot change shape, so an offloaded grad is None.
        """
        out: list[tuple[torch.Tensor, Callable]] = []
        if kind == "params":
            for p in self.model.parameters():
                out.append((p.data, lambda t, p=p: setattr(p, "data", t)))
        elif hasattr(self.optimizer, "offload_tensors"):  # services/trainer/optimizer.py knows its own tensors
            out.extend(self.optimizer.offload_tensors(kind))
        elif kind == "grads":
            for p in self.model.parameters():
                if p.grad is not None:
                    out.append((p.grad, lambda t, p=p: setattr(p, "grad", t)))
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        out.append((value, lambda t, state=state, key=key: state.__setitem__(key, t)))
        return out

    def _move_out(self, record: _Offload, tensor: torch.Tensor, restore: Callable,
                  vacant: torch.Tensor | None) -> int:
        slot = _Slot(restore, shape=tuple(tensor.shape), dtype=tensor.dtype,
                     nbytes=tensor.numel() * tensor.element_size())
        if self.device.type != "cpu":
            slot.host = tensor.detach().to("cpu")
        else:
            if record.spill is None:
                record.spill = tempfile.TemporaryFile(prefix="rlfabric-offload-")
            record.spill.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        restore(vacant)
        record.slots.append(slot)
        return slot.nbytes

    def _move_in(self, record: _Offload, slot: _Slot) -> int:
        if slot.host is not None:
            slot.restore(slot.host.to(self.device))
            return slot.nbytes
        raw = torch.empty(slot.nbytes, dtype=torch.uint8)
        if slot.nbytes and record.spill.readinto(memoryview(raw.numpy())) != slot.nbytes:
            raise OSError("the offload spill file is shorter than what was written to it")
        slot.restore(raw.view(slot.dtype).reshape(slot.shape))
        return slot.nbytes


def _empty_device_cache(device: torch.device) -> None:
    # The device's caching allocator keeps freed blocks for this process; the rollout engine needs them back.
    backend = getattr(torch, device.type, None)
    if backend is not None and hasattr(backend, "empty_cache"):
        backend.empty_cache()


def _checked(kinds: Iterable[str]) -> list[str]:
    kinds = list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown offload kind(s) {bad}; the kinds are {list(KINDS)}")
    return kinds
