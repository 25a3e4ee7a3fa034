"""The weight-sync resharding plan: which trainer shard slices compose each tensor a rollout replica loads.

`plan_resharding(trainer_shards, rollout_params, model_config) -> ReshardPlan` is a pure function (no I/O):

- `trainer_shards`: the trainer's layout, as `Trainer.Info(include_parameters=True)` reports it (Megatron
  names with model-wide layer numbers and, for MoE models, expert numbers local to the EP rank, per
  (tp_rank, pp_rank, ep_rank) shapes); the TP, PP and EP sizes follow from it, and so do the layers of each
  pipeline stage (uneven under MindSpeed's num_layer_list / noop_layers).
- `rollout_params`: what one replica loads, as `Rollout.Info(include_parameters=True)` reports it: the HF
  checkpoint names and full shapes that `UpdateWeights` takes. The replica receives full, unsharded HF
  tensors and fuses and shards them itself, so its own TP size does not change the plan.
- `model_config`: the architecture (a raw HF config dict, or any object with the `ModelSpec` fields).

The plan lists, per HF tensor in send order, the trainer shard slices that compose it and how (concat dim,
QKV / gate-up re-lay, vocabulary padding cut); the layout knowledge itself lives in
services/common/weight_layout.py. It is validated here, not at push time: every trainer shard it reads must
exist with the expected shape, and every rollout parameter must be covered exactly once with a matching
shape; the first mismatch raises `ReshardError` naming the tensor. Plans travel as a `trainer_pb2.ReshardPlan`
message in `PushWeightsRequest.plan` (`ReshardPlan.to_proto` / `ReshardPlan.from_proto`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.common import tensor_recipes, weight_layout
from services.common.model_spec import ModelSpec, spec_from_hf_config
from services.common.reshard_plan import ReshardError, ReshardPlan
from services.common.tensors import dtype_name


@dataclasses.dataclass(frozen=True)
class TrainerShard:
    """One parameter shard on one trainer rank (a `trainer_pb2.ShardInfo`)."""

    name: str  # Megatron name, model-wide layer numbering (experts numbered locally to the EP rank)
    shape: tuple[int, ...]
    tp_rank: int
    pp_rank: int
    ep_rank: int = 0

    @classmethod
    def of(cls, x: Any) -> TrainerShard:
        """From a ShardInfo proto, a dict (worker shard_infos) or a TrainerShard (no ep_rank: 0)."""
        if isinstance(x, TrainerShard):
            return x
        get = x.get if isinstance(x, Mapping) else lambda k, default=None: getattr(x, k, default)
        return cls(str(get("name")), tuple(int(n) for n in get("shape")), int(get("tp_rank")), int(get("pp_rank")),
                   int(get("ep_rank", 0) or 0))


def model_facts(model_config: Mapping[str, Any] | ModelSpec) -> ModelSpec:
    if isinstance(model_config, Mapping):
        return spec_from_hf_config(dict(model_config))
    return model_config


def plan_resharding(
    trainer_shards: Iterable[Any],
    rollout_params: Mapping[str, Sequence[int]] | Iterable[Any],
    model_config: Mapping[str, Any] | ModelSpec,
    *,
    dtype: str | None = None,
) -> ReshardPlan:
    """The plan moving the trainer's shards into the rollout's tensors (see module docstring).

    `rollout_params`: HF name -> shape, or items with `.name`, `.shape` (and optionally `.dtype`, a DType
    enum value or a name), such as `rollout_pb2.ParameterInfo`. `dtype` overrides the plan's dtype to send; by
    default it is the dtype holding most of the rollout parameters' elements when they report one. A tensor the
    replica keeps in another dtype (vLLM's float32 e_score_correction_bias in a bf16 engine) is sent in its own,
    so the replica receives exactly the trainer's values wherever it can hold them.
    """
    spec = model_facts(model_config)
    shards = [TrainerShard.of(s) for s in trainer_shards]
    if not shards:
        raise ReshardError("the trainer reported no shards; call Trainer.Info with include_parameters=true")
    tp = max(s.tp_rank for s in shards) + 1
    pp = max(s.pp_rank for s in shards) + 1
    ep = max(s.ep_rank for s in shards) + 1
    # The layers of each stage, as the trainer reports them (an uneven num_layer_list / noop_layers layout too).
    stages = weight_layout.stage_layers_of_names([[s.name for s in shards if s.pp_rank == p] for p in range(pp)])
    try:
        recipes = weight_layout.recipes(spec, tp, pp, ep, stages)
    except ValueError as e:
        raise ReshardError(f"trainer layout TP={tp} PP={pp} EP={ep}, stage layers {list(stages)} does not fit the "
                           f"model: {e}") from e
    _check_trainer_shards(shards, spec, tp, pp, ep, stages)
    wanted, dtypes = _rollout_hf_shapes(rollout_params, spec)
    by_name = {r.hf_name: r for r in recipes}
    for name, shape in wanted.items():
        r = by_name.get(name)
        if r is None:
            raise ReshardError(f"rollout parameter {name!r} has no counterpart in the trainer's model (Rollout.Info "
                               f"lists HF checkpoint names; is the replica serving another architecture?)")
        if r.hf_shape != shape:
            raise ReshardError(f"rollout parameter {name!r} has shape {shape}, the trainer's model gives {r.hf_shape}")
    missing = [r.hf_name for r in recipes if r.hf_name not in wanted]
    if missing:
        raise ReshardError(f"the rollout does not load {missing[0]!r} ({len(missing)} trainer tensors uncovered); "
                           f"is the replica serving another architecture?")
    if dtype is None:
        dtype = _bulk_dtype(dtypes, wanted)
    tensor_dtypes = {name: dt for name, dt in dtypes.items() if dt != dtype}
    # What the trainer needs to cut and join each tensor; mirrors, re-lay and layer labels stay layout facts.
    tensors = tuple(tensor_recipes.TensorRecipe(r.hf_name, r.hf_shape, r.sources, r.concat_dim) for r in recipes)
    return ReshardPlan(tp, pp, tensors, dtype, ep, tensor_dtypes)


def _check_trainer_shards(shards: list[TrainerShard], spec: ModelSpec, tp: int, pp: int, ep: int,
                          stages: tuple[int, ...]) -> None:
    expected = weight_layout.shard_shapes(spec, tp, pp, ep, stages)
    seen: set[tuple[str, int, int, int]] = set()
    for s in shards:
        where = f"tp_rank {s.tp_rank}, pp_rank {s.pp_rank}" + (f", ep_rank {s.ep_rank}" if ep > 1 else "")
        local, stage = weight_layout.local_layer_name(s.name, stages)
        if stage is not None and stage != s.pp_rank:
            raise ReshardError(f"trainer shard {s.name!r} is on pp_rank {s.pp_rank}, but layer numbering puts it "
                               f"on stage {stage} of {pp} (stages hold {list(stages)} layers)")
        want = expected[(s.tp_rank, s.pp_rank, s.ep_rank)].get(local)
        if want is None:
            raise ReshardError(f"trainer shard {s.name!r} ({where}) is not part of the supported layout "
                               f"(Qwen2 / Qwen3 / Llama, Qwen3-MoE, DeepSeek-V3)")
        if tuple(s.shape) != want:
            raise ReshardError(f"trainer shard {s.name!r} ({where}) has shape {s.shape}, the layout for TP={tp} "
                               f"PP={pp} EP={ep} expects {want}")
        seen.add((local, s.tp_rank, s.pp_rank, s.ep_rank))
    for (t, p, e), names in expected.items():
        for name in names:
            if (name, t, p, e) not in seen:
                rank = f"tp_rank {t}, pp_rank {p}" + (f", ep_rank {e}" if ep > 1 else "")
                raise ReshardError(f"trainer shard {name!r} of {rank} (stage-local name) was not reported")


def _rollout_hf_shapes(params: Any, spec: ModelSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """HF name -> shape the rollout loads, and HF name -> dtype the rollout keeps it in (where reported)."""
    items: list[tuple[str, tuple[int, ...], Any]]
    if isinstance(params, Mapping):
        items = [(n, tuple(int(d) for d in s), None) for n, s in params.items()]
    else:
        items = [(p.name, tuple(int(d) for d in p.shape), getattr(p, "dtype", None)) for p in params]
    out: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for name, shape, dt in items:
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the replica's lm_head is its embedding, which is sent
        if name in out:
            raise ReshardError(f"rollout parameter {name!r} is listed twice")
        out[name] = shape
        if dt is not None and dt != "" and dt != 0:
            dtypes[name] = dt.removeprefix("torch.") if isinstance(dt, str) else dtype_name(int(dt))
    return out, dtypes


def _bulk_dtype(dtypes: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The dtype holding most of the reported elements (the engine's model dtype), "" when none is reported: the
    plan's dtype, so that only the odd tensors need one of their own."""
    elements: dict[str, int] = {}
    for name, dt in dtypes.items():
        elements[dt] = elements.get(dt, 0) + math.prod(shapes[name])
    return max(elements, key=elements.__getitem__, default="")
