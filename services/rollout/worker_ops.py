"""Functions that run inside the vLLM worker (via `collective_rpc` / `apply_model`).

They live at module level so that multiprocess executors (TP > 1 on devices) can pickle them. Each one
takes the worker (or its model) as vLLM passes it and returns plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.rollout import moe_weights


def parameter_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def held_dtypes(hf_names: list[str], model: Any) -> dict[str, Any]:
    """HF name -> dtype of the vLLM parameter loading it writes into (the fused one for q/k/v, gate/up and the
    experts: moe_weights.target), for the names it places in a float dtype the wire carries; the others (a model's
    own renaming, quantized storage) stay at the model dtype."""
    import torch

    carried = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    out = {}
    for name in hf_names:
        target = moe_weights.target(name, params, packed)
        if target is not None and params[target].dtype in carried:
            out[name] = params[target].dtype
    return out


def load_weights(tensors: Any, model: Any, first: bool = True) -> int:
    """Loads named HF tensors through the model's own `load_weights`. A streamed bucket (weight_checks.Verified,
    in this process) has the tensors whose place in the parameters is known copied there while they are
    checked (`_Placements`); the rest go through vLLM's loader, which is watched to learn their places.
    `first`: the first piece of an update, when the places are checked against the parameters (nothing else
    runs on the engine between the pieces of one update)."""
    import torch

    with torch.no_grad():
        placing = getattr(tensors, "placing", None)
        if placing is None:
            loaded = model.load_weights(iter(tensors))
            return len(loaded) if loaded is not None else len(tensors)
        places = _Placements.of(model)
        names = tensors.names
        views = places.current(recheck=first)
        stream = placing(views)
        if not places.knows(names):
            with places.learning() as learn:
                model.load_weights(learn.watch(stream))
        elif all(n in views for n in names):
            # Every tensor has its place: vLLM's loader (a walk over the modules per call) only gets what a
            # dtype other than the engine's kept out of place.
            rest = list(stream)
            if rest:
                model.load_weights(iter(rest))
        else:
            model.load_weights(stream)
        return len(names)


class _Placements:
    """Where vLLM's loader puts each whole HF tensor: one contiguous view of one parameter per name, with the
    tensor's dtype and size (TP 1: q/k/v and gate/up are row ranges of the fused parameter). Learnt by
    watching real loads (`learning`), never written by hand, so a placed copy writes exactly what the loader
    wrote. A name whose loading did anything else (copied a slice or a transpose, copied twice, into device
    memory) stays with the loader, and so does every name of a load that wrote a parameter from anything
    else (a fill, a cast, arithmetic). Forgotten when any parameter moves (sleep and wake, re-processing)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._views: dict[str, Any] = {}
        self._unplaceable: set[str] = set()
        self._where = self._locations()

    @classmethod
    def of(cls, model: Any) -> _Placements:
        places = getattr(model, "_rlfabric_placements", None)
        if places is None:
            places = model._rlfabric_placements = cls(model)
        return places

    def _locations(self) -> tuple[tuple[int, int], ...]:
        # Each Parameter object and its storage: vLLM may swap in new Parameter objects (weight processing,
        # sleep and wake) as well as move their data.
        return tuple((id(p), p.data_ptr()) for p in self._model.parameters())

    def current(self, recheck: bool = True) -> dict[str, Any]:
        """The known views, after dropping them all if a parameter moved since they were learnt (`recheck`)."""
        if not recheck:
            return self._views
        where = self._locations()
        if where != self._where:
            self._views.clear()
            self._unplaceable.clear()
            self._where = where
        return self._views

    def knows(self, names: list[str]) -> bool:
        return all(n in self._views or n in self._unplaceable for n in names)

    def learning(self) -> _LearnPlacements:
        return _LearnPlacements(self)

    def learnt(self, loaded: list[str], copies: dict[str, list[Any]], partial: set[str], other_writes: bool) -> None:
        for name in loaded:
            views = copies.get(name, [])
            if other_writes or name in partial or len(views) != 1 or views[0].device.type != "cpu":
                self._unplaceable.add(name)
            else:
                self._views[name] = views[0]


class _LearnPlacements:
    """A torch function mode over one `load_weights` call that records, per yielded tensor, the parameter
    views it is copied into whole (see `_Placements`)."""

    def __init__(self, places: _Placements) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        storages = {p.untyped_storage().data_ptr() for p in places._model.parameters()}
        sources: list[tuple[str, Any]] = []
        copies: dict[str, list[Any]] = {}
        partial: set[str] = set()
        loaded: list[str] = []
        flags = {"other_writes": False}

        def source_of(src: Any) -> tuple[str, Any] | None:
            """The yielded tensor whose bytes `src` views (whole or in part), if any."""
            at = src.data_ptr()
            for name, tensor in sources:
                start = tensor.data_ptr()
                if start <= at < start + tensor.numel() * tensor.element_size():
                    return name, tensor
            return None

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                target = _written(func, args, kwargs)
                if target is not None and target.numel() and target.untyped_storage().data_ptr() in storages:
                    src = args[1] if getattr(func, "__name__", "") == "copy_" and len(args) > 1 else None
                    found = source_of(src) if isinstance(src, torch.Tensor) and src.numel() else None
                    if found is None:
                        # A write from no yielded tensor (a fill, a cast copy, arithmetic): trust nothing of this load.
                        flags["other_writes"] = True
                    elif (src.data_ptr() == found[1].data_ptr() and src.numel() == found[1].numel()
                          and src.is_contiguous() and target.is_contiguous() and target.dtype == src.dtype):
                        copies.setdefault(found[0], []).append(target.detach())
                    else:
                        partial.add(found[0])  # a slice or a transpose of it
                return func(*args, **kwargs)

        self._places, self._mode = places, _Mode()
        self._sources, self._copies, self._partial, self._loaded, self._flags = (
            sources, copies, partial, loaded, flags)

    def watch(self, stream):
        for name, tensor in stream:
            self._loaded.append(name)
            if tensor.numel():
                self._sources.append((name, tensor))
            yield name, tensor

    def __enter__(self) -> _LearnPlacements:
        self._mode.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._mode.__exit__(kind, value, tb)
        if kind is None:
            self._places.learnt(self._loaded, self._copies, self._partial, self._flags["other_writes"])


def _written(func: Any, args: tuple, kwargs: dict) -> Any:
    """The tensor a torch call writes into (in-place methods, item assignment, `out=`), or None."""
    import torch

    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    if args and isinstance(args[0], torch.Tensor) and (
            name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))):
        return args[0]
    return None


class _Backup:
    """The values a streamed update overwrote, to put back if it fails (engine.py `restore_weights`).

    Buffers are kept across pushes (allocated once per parameter, on the host), so a push copies into warm
    pages; `saved` names the parameters this push has backed up so far."""

    def __init__(self, model: Any) -> None:
        self.params = dict(model.named_parameters())
        # vLLM loads q/k/v, gate/up and each expert shard by shard into one fused parameter: the backup
        # covers all of it (moe_weights.target).
        self.packed = dict(getattr(model, "packed_modules_mapping", {}))
        self.buffers: dict[str, Any] = {}
        self.saved: set[str] = set()

    def target(self, hf_name: str) -> str | None:
        """The vLLM parameter loading `hf_name` writes into, or None when this mapping does not know it."""
        return moe_weights.target(hf_name, self.params, self.packed)

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


def read_weights(names: list[str], hf_shapes: Mapping[str, tuple[int, ...]], model: Any) -> dict[str, Any]:
    """Host copies of the named HF tensors as the engine holds them (moe_weights.view); a name without a
    known view maps to None."""
    import torch

    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name in names:
            held = moe_weights.view(name, params, packed, hf_shapes)
            out[name] = None if held is None else held.detach().to("cpu", copy=True)
    return out


def load_weights_with_backup(names: list[str], tensors: Any, model: Any, first: bool = True) -> int:
    """`load_weights` after saving the current values of every parameter that loading `names` writes into."""
    import torch

    backup = getattr(model, "_rlfabric_backup", None)
    if backup is None:
        backup = model._rlfabric_backup = _Backup(model)
    with torch.no_grad():
        backup.save(list(names))
    return load_weights(tensors, model, first)


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
