"""Functions that run inside the vLLM worker (via `collective_rpc` / `apply_model`).

They live at module level so that multiprocess executors (TP > 1 on devices) can pickle them. Each one
takes the worker (or its model) as vLLM passes it and returns plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def load_weights(tensors: list[tuple[str, Any]], model: Any) -> int:
    import torch

    with torch.no_grad():
        loaded = model.load_weights(iter(tensors))
    return len(loaded) if loaded is not None else len(tensors)


class _Backup:
    """The values a streamed update overwrote, to put back if it fails (engine.py `restore_weights`).

    Buffers are kept across pushes (allocated once per parameter, on the host), so a push copies into warm
    pages; `saved` names the parameters this push has backed up so far."""

    def __init__(self, model: Any) -> None:
        self.params = dict(model.named_parameters())
        # vLLM loads q/k/v and gate/up shard by shard into one fused parameter: the backup covers all of it.
        self.packed = {part: fused for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
                       for part in parts}
        self.buffers: dict[str, Any] = {}
        self.saved: set[str] = set()

    def target(self, hf_name: str) -> str | None:
        """The vLLM parameter loading `hf_name` writes into, or None when this mapping does not know it."""
        if hf_name in self.params:
            return hf_name
        for part, fused in self.packed.items():
            name = hf_name.replace(f".{part}.", f".{fused}.")
            if name != hf_name and name in self.params:
                return name
        return None

    def save(self, hf_names: list[str]) -> None:
        import torch

        targets = [self.target(n) for n in hf_names]
        # A name this mapping cannot place (a model's own renaming): back up every parameter rather than guess.
        names = self.params if None in targets else targets
        for name in names:
            if name in self.saved:
                continue
            param = self.params[name]
            buf = self.buffers.get(name)
            if buf is None or buf.shape != param.shape or buf.dtype != param.dtype:
                # Pinned for device parameters: the copy to the host then runs at the link's full speed.
                buf = self.buffers[name] = torch.empty(param.shape, dtype=param.dtype, device="cpu",
                                                       pin_memory=param.is_cuda)
            buf.copy_(param.detach())
            self.saved.add(name)


def load_weights_with_backup(names: list[str], tensors: Any, model: Any) -> int:
    """`load_weights` after saving the current values of every parameter that loading `names` writes into."""
    import torch

    backup = getattr(model, "_rlfabric_backup", None)
    if backup is None:
        backup = model._rlfabric_backup = _Backup(model)
    with torch.no_grad():
        backup.save(list(names))
    return load_weights(tensors, model)


def restore_backup(model: Any) -> int:
    """Puts back what this push's `load_weights_with_backup` overwrote; returns the number of parameters."""
    import torch

    backup = getattr(model, "_rlfabric_backup", None)
    if backup is None:
        return 0
    with torch.no_grad():
        for name in backup.saved:
            backup.params[name].copy_(backup.buffers[name])
    restored = len(backup.saved)
    backup.saved.clear()
    return restored


def drop_backup(model: Any) -> int:
    """Ends a push that completed: its backup is stale (the buffers stay for the next push)."""
    backup = getattr(model, "_rlfabric_backup", None)
    if backup is None:
        return 0
    saved = len(backup.saved)
    backup.saved.clear()
    return saved


def _kv_storages(worker: Any) -> list[Any]:
    """The distinct storages behind the worker's KV-cache tensors."""
    import torch

    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                collect(y)
        elif isinstance(x, Mapping):
            for y in x.values():
                collect(y)

    runner = worker.model_runner
    collect(getattr(runner, "kv_caches", []))
    for layer in runner.compilation_config.static_forward_context.values():
        collect(getattr(layer, "kv_cache", None))
    storages: dict[int, Any] = {}
    for t in found:
        s = t.untyped_storage()
        storages.setdefault(s.data_ptr(), s)
    return list(storages.values())


def release_kv_cache(worker: Any) -> int:
    # Resizing the storage frees its memory while every view of it (the per-layer KV tensors the attention
    # backend holds) stays a valid object; `_restore_kv_cache` gives them memory again.
    storages = _kv_storages(worker)
    sizes = [s.nbytes() for s in storages]
    for s in storages:
        s.resize_(0)
    worker._rlfabric_released_kv = list(zip(storages, sizes, strict=True))
    return sum(sizes)


def restore_kv_cache(worker: Any) -> int:
    import torch

    released = getattr(worker, "_rlfabric_released_kv", [])
    for storage, size in released:
        storage.resize_(size)
        torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
    worker._rlfabric_released_kv = []
    return sum(size for _, size in released)
