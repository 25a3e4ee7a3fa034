"""Which transformer layers each pipeline stage holds: Megatron's even split, MindSpeed's `num_layer_list` and
`noop_layers`, reduced to one tuple, the model's layers per stage (pure Python: no torch, the config package
imports it).

- Even split (neither key): every stage holds num_layers / PP layers.
- `num_layer_list` "a,b,c,...": stage p holds the next `num_layer_list[p]` layers (one entry per stage, their sum
  num_layers).
- `noop_layers` "i,j": layers i and j (global indices of the num_layers, which count them) are identity layers.
  MindSpeed builds each as a `NoopTransformerLayer` without weights in its slot, so the model has num_layers -
  len(noop_layers) layers (an HF config.json's num_hidden_layers) and layers are placed on stages as if the noops
  were layers: Qwen3-235B's num_layers 96, noop_layers "5,95" at PP 16 is 6 slots a stage, stages 0 and 15 with 5
  layers. Model layer k (HF numbering) is the k-th slot that is not a noop.

The trainer builds only the real layers of each stage (an identity slot computes nothing), numbered from 0 on
its stage, so every user of the layout (the trainer's model, conversion, weight export, the resharding plan, the
memory plan) needs just `stage_layers(...)`: the real layers per stage. `stage_slots(...)` keeps the slots, which
bound recompute_num_layers as upstream counts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class StageLayoutError(ValueError):
    """A pipeline layout that cannot be built; `key` is the config key (or flag) at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def layer_numbers(value: Any, key: str) -> tuple[int, ...]:
    """A `num_layer_list` / `noop_layers` value as the integers it lists: "7,7,8" (Megatron's and MindSpeed's
    spelling), a YAML list, or one integer."""
    if value is None:
        return ()
    if isinstance(value, bool):
        raise StageLayoutError(key, f"{key} must list integers, e.g. \"4,4\", got {value!r}")
    if isinstance(value, int):
        return (value,)
    items: Iterable[Any] = value.split(",") if isinstance(value, str) else value
    out = []
    for item in items:
        text = str(item).strip()
        try:
            out.append(int(text))
        except ValueError:
            raise StageLayoutError(key, f"{key} must list integers separated by commas, e.g. \"4,4\", got "
                                        f"{value!r}") from None
    return tuple(out)


def stage_slots(num_layers: int, pp: int, num_layer_list: Any = None) -> tuple[int, ...]:
    """Layers per pipeline stage counting no-op layers (MindSpeed's placement): `num_layer_list`, else even."""
    if pp < 1 or num_layers < 1:
        raise StageLayoutError("pipeline_model_parallel_size", f"num_layers ({num_layers}) and "
                                                               f"pipeline_model_parallel_size ({pp}) must be at least 1")
    if num_layer_list is None:
        if num_layers % pp:
            raise StageLayoutError("pipeline_model_parallel_size", (
                f"num_layers ({num_layers}) must be divisible by pipeline_model_parallel_size ({pp}), or "
                f"num_layer_list must give each stage's layers (e.g. \"{_example(num_layers, pp)}\")"))
        return (num_layers // pp,) * pp
    counts = layer_numbers(num_layer_list, "num_layer_list")
    if len(counts) != pp:
        raise StageLayoutError("num_layer_list", f"num_layer_list {num_layer_list!r} has {len(counts)} entries; it "
                                                 f"needs one per pipeline stage (pipeline_model_parallel_size {pp})")
    if min(counts) < 1:
        raise StageLayoutError("num_layer_list", f"num_layer_list {num_layer_list!r}: every pipeline stage needs at "
                                                 f"least one layer")
    if sum(counts) != num_layers:
        raise StageLayoutError("num_layer_list", f"num_layer_list {num_layer_list!r} sums to {sum(counts)} layers, "
                                                 f"but num_layers is {num_layers}")
    return counts


def noop_set(noop_layers: Any, num_layers: int) -> frozenset[int]:
    """The no-op layers' global indices (of `num_layers`, which counts them); duplicates name one layer, as the set
    MindSpeed makes of them."""
    noops = frozenset(layer_numbers(noop_layers, "noop_layers"))
    bad = sorted(i for i in noops if not 0 <= i < num_layers)
    if bad:
        raise StageLayoutError("noop_layers", f"noop_layers {noop_layers!r}: index {bad[0]} is not a layer of "
                                              f"num_layers {num_layers} (indices 0 to {num_layers - 1}, noops counted)")
    if len(noops) >= num_layers:
        raise StageLayoutError("noop_layers", f"noop_layers {noop_layers!r} leaves no layer of num_layers {num_layers}")
    return noops


def stage_layers(num_layers: int, pp: int, num_layer_list: Any = None, noop_layers: Any = None) -> tuple[int, ...]:
    """The model's (real) layers on each pipeline stage: `stage_slots` less each stage's no-op layers."""
    slots = stage_slots(num_layers, pp, num_layer_list)
    noops = noop_set(noop_layers, num_layers)
    out, first = [], 0
    for p, n in enumerate(slots):
        real = n - sum(1 for i in noops if first <= i < first + n)
        if real < 1:
            raise StageLayoutError("noop_layers", f"noop_layers {noop_layers!r} fill pipeline stage {p} (layers "
                                                  f"{first} to {first + n - 1}): every stage needs a layer that is "
                                                  f"not a no-op")
        out.append(real)
        first += n
    return tuple(out)


def stage_layers_of_model(model_layers: int, pp: int, num_layer_list: Any = None, noop_layers: Any = None
                          ) -> tuple[int, ...]:
    """`stage_layers` for a model of `model_layers` layers (an HF num_hidden_layers): Megatron's num_layers is that
    plus the no-op layers (what a converter's --num-layer-list / --noop-layers describe)."""
    noops = set(layer_numbers(noop_layers, "noop_layers"))
    return stage_layers(model_layers + len(noops), pp, num_layer_list, noop_layers)


def model_layer_slots(num_layers: int, noop_layers: Any = None) -> tuple[int, ...]:
    """The global slot of each model layer (entry k: where HF layer k sits among num_layers, noops counted)."""
    noops = noop_set(noop_layers, num_layers)
    return tuple(i for i in range(num_layers) if i not in noops)


def check_stage_layers(stages: Sequence[int], num_layers: int, pp: int) -> tuple[int, ...]:
    """`stages` (model layers per stage) as a tuple, when it places `num_layers` layers on `pp` stages."""
    out = tuple(int(n) for n in stages)
    if len(out) != pp or min(out, default=0) < 1 or sum(out) != num_layers:
        raise StageLayoutError("num_layer_list", f"pipeline stage layers {list(out)} do not place {num_layers} layers "
                                                 f"on {pp} stages (one entry per stage, each at least 1, summing "
                                                 f"to {num_layers})")
    return out


def stage_range(stages: Sequence[int], stage: int) -> range:
    """The model layers stage `stage` holds."""
    first = sum(stages[:stage])
    return range(first, first + stages[stage])


def stage_of_layer(stages: Sequence[int], layer: int) -> tuple[int, int]:
    """(stage, number on that stage) of model layer `layer`."""
    first = 0
    for p, n in enumerate(stages):
        if layer < first + n:
            return p, layer - first
        first += n
    raise ValueError(f"layer {layer} is past the last pipeline stage (stages hold {list(stages)} layers)")


def _example(num_layers: int, pp: int) -> str:
    """A num_layer_list that places `num_layers` on `pp` stages (the last stages one layer more)."""
    base, extra = divmod(num_layers, pp)
    return ",".join(str(base + (p >= pp - extra)) for p in range(pp))
