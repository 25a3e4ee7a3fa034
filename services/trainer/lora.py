"""LoRA on the trainer's Megatron linears: MindSpeed-RL's `lora_r`, `lora_alpha`, `lora_target_modules`, with what
`lora_ckpt_filter` (checkpoints of the adapters only) and `share_backbone` (the reference is the actor's backbone
with its adapters off) need.

Owns: adding adapters to a built GPTModel and freezing everything else (`apply_lora`), the forward without them
(`adapters_disabled`), the merged weights W + (alpha / r) B A under the base names (`merged_parameters`, for the
weight sync), the adapters' state (`adapter_state_dict` / `load_adapter_state_dict`: this rank's shards, for
checkpoints; `gather_adapter_state_dict` / `load_adapter_state_dict(whole=True)`: whole tensors, any TP size) and
their size (`adapter_numel`, `adapter_bytes`, `planned_adapter_numel`).

How an adapted layer computes. The adapter is a second path beside the frozen layer, as PEFT's Megatron LoRA
(`LoraParallelLinear`) lays it out: y = base(x) + scaling * B(A(x)), A [r, in] initialised as PEFT does
(kaiming-uniform, a = sqrt(5)), B [out, r] zeros, so a fresh adapter changes nothing. The merged weight is never
formed in the forward: it would be a weight-sized tensor per layer, kept for backward, where the path keeps one
[tokens, r] activation. Under tensor parallelism the adapter is split as its base weight is, and the only
communication is on the rank-r activation:

| layer (targets)                     | A [r, in]              | B [out, r]          | the r-wide activation h = A x    |
|-------------------------------------|------------------------|---------------------|----------------------------------|
| column-parallel (linear_qkv, fc1)   | whole on every rank    | rows of this rank   | copy to TP (backward: all-reduce)|
| row-parallel (linear_proj, fc2)     | columns of this rank   | whole on every rank | all-reduce over TP (partial sums)|

With sequence parallelism the layer's input (column) or output (row) is this rank's slice of the sequence, so
h is all-gathered over the sequence (column) or reduce-scattered onto it (row) instead, and the whole matrix
(A of a column layer, B of a row layer) sees only this rank's tokens: its gradient is a partial sum. It enters
through `copy_to_tensor_model_parallel_region`, whose backward all-reduces over TP, so every rank ends the
backward with the whole gradient (without sequence parallelism every rank already computes the whole, equal,
gradient). The optimizer then needs nothing LoRA-specific: it keeps state for `requires_grad` parameters only,
and grad-norm counts the whole matrices once (`tensor_model_parallel` False) and the split ones on every rank.
On each rank the merged shard is W_shard + scaling * B_local A_local, whichever the kind.

Adapter parameters are children of their layer (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`, PEFT's names
without its adapter name), so the base names never change. A is drawn from a generator seeded by `seed` and the
model-wide parameter name, whole, before this rank takes its part: every TP / PP layout starts from the same
adapters. The embedding's output is marked as requiring grad, as PEFT's `enable_input_require_grads`: with
everything below the first adapter frozen, Megatron's full recompute (a reentrant checkpoint) would otherwise
see inputs without grad and give its layers' adapters none.

Megatron's local-spec layers only (the CPU spec); TransformerEngine's fuse the norm into linear_qkv / linear_fc1
and are refused by class name, as are expert layers (MoE experts have their own TP group and dispatch).
`apply_lora` comes after the base weights are loaded and before the optimizer is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.nn import functional

from services.common.model_spec import ModelSpec
from services.common.weight_layout import global_layer_name
from services.trainer.model import canonical_name, config_stage_layers, unwrap

# Megatron's module name -> how its weight is split over TP (MindSpeed-LLM's lora_target_modules).
TARGET_KINDS: dict[str, str] = {"linear_qkv": "column", "linear_proj": "row",
                                "linear_fc1": "column", "linear_fc2": "row"}
_ADAPTER_PARTS = ("lora_A", "lora_B")


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """`lora_r`, `lora_alpha`, `lora_target_modules`; `seed` draws A (the same on every rank)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = tuple(TARGET_KINDS)
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora_r must be a positive integer, not {self.rank!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora_alpha must be a positive number, not {self.alpha!r}")
        if isinstance(self.target_modules, str):
            raise ValueError(f"lora_target_modules is a list of module names, not the string {self.target_modules!r}")
        targets = tuple(dict.fromkeys(self.target_modules))
        unknown = [t for t in targets if t not in TARGET_KINDS]
        if unknown:
            raise ValueError(f"lora_target_modules: unknown module(s) {unknown}; LoRA adapts {list(TARGET_KINDS)}")
        if not targets:
            raise ValueError(f"lora_target_modules is empty; name at least one of {list(TARGET_KINDS)}")
        object.__setattr__(self, "target_modules", targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class _Matrix(torch.nn.Module):
    """Holds one adapter matrix as `weight`, so it is named `<layer>.lora_A.weight` as in PEFT."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


@dataclasses.dataclass(eq=False)
class _Adapter:
    """One adapted layer: what its forward hook adds (module docstring)."""

    layer: torch.nn.Module
    kind: str  # "column" or "row"
    scaling: float
    enabled: bool = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as mp

        a, b, group = self.layer.lora_A.weight, self.layer.lora_B.weight, self.layer.tp_group
        sp = self.layer.sequence_parallel
        if self.kind == "column":
            if sp:
                a = mp.copy_to_tensor_model_parallel_region(a, group=group)  # a partial gradient: summed over TP
                h = mp.gather_from_sequence_parallel_region(functional.linear(x, a), tensor_parallel_output_grad=True,
                                                            group=group)
            else:
                h = mp.copy_to_tensor_model_parallel_region(functional.linear(x, a), group=group)
        else:
            h = functional.linear(x, a)  # this rank's share of A x
            if sp:
                h = mp.reduce_scatter_to_sequence_parallel_region(h, group=group)
                b = mp.copy_to_tensor_model_parallel_region(b, group=group)
            else:
                h = mp.reduce_from_tensor_model_parallel_region(h, group=group)
        return functional.linear(h, b) * self.scaling

    def hook(self, _module, args, kwargs, output):
        if not self.enabled:
            return output  # the base layer's output object itself: bitwise the base model
        if kwargs.get("runtime_gather_output"):
            raise ValueError("a LoRA-adapted column-parallel layer cannot gather its output")
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x), bias

    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B A of this rank's shard, in the weight's dtype (summed in fp32), with its TP attributes."""
        from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

        w = self.layer.weight
        with torch.no_grad():
            delta = (self.layer.lora_B.weight.float() @ self.layer.lora_A.weight.float()) * self.scaling
            merged = (w.float() + delta).to(w.dtype)
        copy_tensor_model_parallel_attributes(merged, w)
        return merged


def apply_lora(model, opts: LoraOptions) -> int:
    """Add adapters to every target layer of `model` (a built GPTModel, base weights loaded) and freeze every other
    parameter; returns the number of layers adapted on this rank. Refuses a model that already has adapters, a
    target that names no layer, and layers it cannot adapt (TransformerEngine, experts, gathered outputs)."""
    if adapters(model):
        raise ValueError("the model already has LoRA adapters")
    found = _target_layers(model, opts)
    for p in model.parameters():
        p.requires_grad_(False)
    gpt = unwrap(model)
    stages = config_stage_layers(gpt.config)
    pp_rank = _pp_rank()
    for name, layer in found:
        _add_adapter(layer, name.rpartition(".")[2], opts, seed_name=global_layer_name(canonical_name(name), pp_rank, stages))
    if getattr(gpt, "pre_process", False) and getattr(gpt, "embedding", None) is not None:
        gpt.embedding.register_forward_hook(_input_requires_grad)
    return len(found)


def _target_layers(model, opts: LoraOptions) -> list[tuple[str, torch.nn.Module]]:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    classes = {"column": ColumnParallelLinear, "row": RowParallelLinear}
    found, seen = [], set()
    for name, module in model.named_modules():
        attr = name.rpartition(".")[2]
        if attr not in opts.target_modules:
            continue
        kind = TARGET_KINDS[attr]
        if not isinstance(module, classes[kind]):
            raise ValueError(f"LoRA adapts Megatron's local-spec {classes[kind].__name__}; {name} is "
                             f"{type(module).__name__} (TransformerEngine's layers fuse the norm in and are not supported)")
        if getattr(module, "is_expert", False):
            raise ValueError(f"LoRA does not adapt expert layers: {name}; leave linear_fc1/linear_fc2 out of "
                             "lora_target_modules for a mixture-of-experts model")
        if (kind == "column" and module.gather_output) or (kind == "row" and not module.input_is_parallel):
            raise ValueError(f"{name}: LoRA adapts layers whose output (column) or input (row) stays split over TP")
        found.append((name, module))
        seen.add(attr)
    # A stage holds whole layers, so a target missing from a stage with layers is missing from the model.
    missing = [t for t in opts.target_modules if t not in seen]
    if missing and len(getattr(getattr(unwrap(model), "decoder", None), "layers", ())):
        raise ValueError(f"lora_target_modules: {missing} name no layer of this model")
    return found


def _add_adapter(layer, attr: str, opts: LoraOptions, seed_name: str) -> None:
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    kind, w = TARGET_KINDS[attr], layer.weight
    tp_rank, tp = dist.get_rank(layer.tp_group), dist.get_world_size(layer.tp_group)
    out_local, in_local = w.shape
    in_full = in_local * tp if kind == "row" else in_local
    g = torch.Generator().manual_seed(zlib.crc32(f"{opts.seed}/{seed_name}".encode()))
    a = torch.nn.init.kaiming_uniform_(torch.empty(opts.rank, in_full), a=math.sqrt(5), generator=g)
    if kind == "row":
        a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
    layer.lora_A = _Matrix(a.to(dtype=w.dtype, device=w.device).contiguous())
    layer.lora_B = _Matrix(torch.zeros(out_local, opts.rank, dtype=w.dtype, device=w.device))
    split = {"column": (layer.lora_B, 0), "row": (layer.lora_A, 1)}[kind]
    for m in (layer.lora_A, layer.lora_B):
        is_split = m is split[0]
        set_tensor_model_parallel_attributes(m.weight, is_split, split[1] if is_split else -1, 1)
        # linear_fc1 of a gated MLP holds [gate; up], each split over TP: a shard is [gate_k; up_k].
        m.weight.lora_gated = is_split and attr == "linear_fc1" and bool(layer.config.gated_linear_unit)
    adapter = _Adapter(layer, kind, opts.scaling)
    layer._lora_adapter = adapter
    layer.register_forward_hook(adapter.hook, with_kwargs=True)


def _input_requires_grad(_module, _args, output):
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)


def _pp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank()


def adapters(model) -> list[_Adapter]:
    """The adapted layers of `model` (empty without LoRA)."""
    return [a for m in model.modules() if (a := getattr(m, "_lora_adapter", None)) is not None]


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...lora_A.weight` / `...lora_B.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in _ADAPTER_PARTS and parts[-1] == "weight"


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """The forward of the base model, bitwise, while inside (the reference model under share_backbone)."""
    found = adapters(model)
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, on in zip(found, before, strict=True):
            a.enabled = on


def merged_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.named_parameters()` without the adapters, each adapted weight replaced by its merged shard (new
    tensors, one at a time, carrying the TP attributes weight export reads); the other parameters themselves (as
    `weights_export.exported_tensors` yields them). What the rollout must serve: the base names only."""
    merged = {id(a.layer.weight): a for a in adapters(model)}
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            continue
        a = merged.get(id(p))
        yield name, (a.merged_weight() if a is not None else p)


def adapter_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) of this rank's adapter matrices."""
    for name, p in model.named_parameters():
        if is_adapter_name(name):
            yield canonical_name(name), p


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """This rank's adapter shards (copies), canonical names: what a `lora_ckpt_filter` checkpoint holds."""
    return {name: p.detach().clone() for name, p in adapter_parameters(model)}


def load_adapter_state_dict(model, state: Mapping[str, torch.Tensor], *, whole: bool = False) -> None:
    """Copy adapters into `model`; the names must be exactly its adapters'. `whole`: the tensors are whole (TP 1
    layout, `gather_adapter_state_dict`) and this rank takes its part; else they are this rank's shards
    (`adapter_state_dict`)."""
    own = dict(adapter_parameters(model))
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"adapter state does not match the model's adapters: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    tp, tp_rank = _tp()
    for n, p in own.items():
        want = _whole_shape(p, tp) if whole else tuple(p.shape)
        if tuple(state[n].shape) != want:
            raise ValueError(f"adapter {n} has shape {tuple(state[n].shape)}, the model expects {want}"
                             f"{'' if whole else ' on this rank'}")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(_tp_pieces(p, state[n], tp)[tp_rank] if whole else state[n])


def gather_adapter_state_dict(model, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Whole adapters (TP 1 layout, any TP size; `grads`: their gradients) on every rank of the TP group: a
    collective of the TP group. The inverse of `load_adapter_state_dict(..., whole=True)`."""
    from megatron.core import parallel_state as ps

    tp, _ = _tp()
    out = {}
    for n, p in adapter_parameters(model):
        t = (p.grad if grads else p).detach().contiguous()
        if not p.tensor_model_parallel or tp == 1:
            out[n] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t, group=ps.get_tensor_model_parallel_group())
        if p.lora_gated:  # each shard is [gate_k; up_k]: the whole is [gate; up]
            halves = [q.chunk(2, dim=0) for q in parts]
            out[n] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[n] = torch.cat(parts, dim=p.partition_dim)
    return out


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _whole_shape(p: torch.nn.Parameter, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if p.tensor_model_parallel:
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _tp_pieces(p: torch.nn.Parameter, whole: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each TP rank's part of the whole adapter `whole` (B of a gated linear_fc1: [gate_k; up_k])."""
    if not p.tensor_model_parallel:
        return [whole] * tp
    if p.lora_gated:
        gate, up = (h.chunk(tp, dim=0) for h in whole.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)]
    return list(whole.chunk(tp, dim=p.partition_dim))


def adapter_numel(model) -> int:
    """Elements of this rank's adapter matrices."""
    return sum(p.numel() for _, p in adapter_parameters(model))


def adapter_bytes(model) -> int:
    """Bytes of this rank's adapter matrices (their gradients and Adam state are the optimizer's memory_bytes)."""
    return sum(p.numel() * p.element_size() for _, p in adapter_parameters(model))


def planned_adapter_numel(spec: ModelSpec, opts: LoraOptions, *, tp: int = 1, layers: int | None = None) -> int:
    """Adapter elements per TP rank of a dense grouped-query model over `layers` layers (default: all), without
    building it: r (in + out / tp) per column-parallel target, r (in / tp + out) per row-parallel one."""
    if spec.mla is not None or (spec.moe is not None and {"linear_fc1", "linear_fc2"} & set(opts.target_modules)):
        raise ValueError("planned_adapter_numel counts dense grouped-query models (no MLA, no expert layers)")
    h, attn = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    shapes = {"linear_qkv": (h, qkv), "linear_proj": (attn, h),
              "linear_fc1": (h, 2 * spec.intermediate_size), "linear_fc2": (spec.intermediate_size, h)}
    per_layer = 0
    for t in opts.target_modules:
        fan_in, fan_out = shapes[t]
        per_layer += opts.rank * ((fan_in + fan_out // tp) if TARGET_KINDS[t] == "column" else (fan_in // tp + fan_out))
    return per_layer * (spec.num_hidden_layers if layers is None else layers)
