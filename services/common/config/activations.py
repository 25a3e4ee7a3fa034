"""Rules of the activation-memory keys (`recompute_*`, `sequence_parallel`) as Megatron applies them.

`recompute_problem` is the one statement of which recompute combinations Megatron runs; the config rules
here name the key and its section, and the trainer (services/trainer/activation_memory.py) checks the same
rule on what it is given. Megatron-LM's arguments.py refuses a method with `selective`; TransformerConfig
refuses an unknown granularity or method, `full` without a method or a layer count, and `selective` with
a layer count; `uniform` must also divide a pipeline stage's layers (Megatron's uniform loop indexes past the
stage's last layer otherwise, transformer_block.py `_checkpointed_forward`). Uneven stages (num_layer_list,
noop_layers; services/common/pipeline_layout.py) are counted as upstream builds them, no-op layers included:
`uniform` must divide every stage's, and `block` recomputes at most the largest stage's layers. Settings Megatron
accepts and ignores are warnings: a method or layer count without a granularity, sequence_parallel at TP 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from services.common import pipeline_layout
from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.resolved import RLFabricConfig
GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def recompute_problem(granularity: str | None, method: str | None, num_layers: int | None,
                      layers_per_stage: int | Sequence[int] | None = None) -> tuple[str, str] | None:
    """(key, message) of what is wrong with a recompute combination; None when Megatron runs it.

    `layers_per_stage`: every pipeline stage's layers, or each stage's (uneven stages, no-op layers counted)."""
    if granularity is None:
        return None
    if granularity not in GRANULARITIES:
        return "recompute_granularity", f"recompute_granularity must be full or selective (or unset), got {granularity!r}"
    if method is not None and method not in METHODS:
        return "recompute_method", f"recompute_method must be uniform or block, got {method!r}"
    if granularity == "selective":
        if method is not None:
            return "recompute_method", (
                f"recompute_method ({method}) is not supported with recompute_granularity: selective (Megatron "
                f"then recomputes the core attention of every layer); remove recompute_method")
        if num_layers is not None:
            return "recompute_num_layers", (
                f"recompute_num_layers ({num_layers}) must be unset with recompute_granularity: selective; remove it")
        return None
    if method is None:
        return "recompute_method", "recompute_granularity: full needs recompute_method: uniform or block"
    if num_layers is None:
        return "recompute_num_layers", (
            f"recompute_granularity: full needs recompute_num_layers (with {method}: "
            + ("layers per recomputed unit)" if method == "uniform" else "layers recomputed per pipeline stage)"))
    if num_layers < 1:
        return "recompute_num_layers", f"recompute_num_layers must be at least 1, got {num_layers}"
    if layers_per_stage is None:
        return None
    stages = (layers_per_stage,) if isinstance(layers_per_stage, int) else tuple(layers_per_stage)
    what = "one pipeline stage" if len(set(stages)) == 1 else "the largest pipeline stage"
    if num_layers > max(stages):
        return "recompute_num_layers", (
            f"recompute_num_layers ({num_layers}) must be between 1 and the layers of {what} ({max(stages)})")
    if method == "uniform" and any(n % num_layers for n in stages):
        sizes = str(stages[0]) if len(set(stages)) == 1 else ", ".join(map(str, stages))
        return "recompute_num_layers", (
            f"recompute_num_layers ({num_layers}) must divide the layers of every pipeline stage ({sizes}) with "
            f"recompute_method: uniform")
    return None


def _sections(cfg: RLFabricConfig):
    """(key prefix, Megatron section) of the actor, and of the reference when it has its own."""
    yield "", cfg.actor_config
    if cfg.ref_config is not cfg.actor_config:
        yield "ref_config.", cfg.ref_config


def _layers_per_stage(mt) -> tuple[int, ...] | None:
    """Each pipeline stage's layers as upstream builds them (num_layer_list, no-op layers counted)."""
    if mt.num_layers is None:
        return None
    try:
        pipeline_layout.stage_layers(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list,
                                     mt.noop_layers)
        return pipeline_layout.stage_slots(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list)
    except pipeline_layout.StageLayoutError:
        return None  # validation.py's pipeline rule reports it


def activation_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    for prefix, mt in _sections(cfg):
        found = recompute_problem(mt.recompute_granularity, mt.recompute_method, mt.recompute_num_layers,
                                  _layers_per_stage(mt))
        if found:
            key, message = found
            yield Problem((f"{prefix}{key}",), message)


def activation_warnings(cfg: RLFabricConfig) -> Iterable[Problem]:
    for prefix, mt in _sections(cfg):
        if mt.recompute_granularity is None:
            unused = [k for k in ("recompute_method", "recompute_num_layers") if getattr(mt, k) is not None]
            if unused:
                yield Problem((f"{prefix}{unused[0]}",),
                              f"{' and '.join(unused)} set without recompute_granularity: nothing is recomputed "
                              f"(as in Megatron); set recompute_granularity: full to use them")
        if mt.sequence_parallel and mt.tensor_model_parallel_size == 1:
            yield Problem((f"{prefix}sequence_parallel",),
                          "sequence_parallel is true at tensor_model_parallel_size 1: it is turned off, as Megatron "
                          "does (sequence parallelism splits activations over TP ranks)")
