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
