"""The resharding plan as it travels: `ReshardPlan`, its JSON form, and its error type.

The coordinator builds plans (`services/coordinator/resharding.py`, `plan_resharding`); the trainer executes
them (`services/trainer/weight_sync.py`). Both only share this data type and the layout rules of
`services/common/weight_layout.py`, so neither service imports the other.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from services.common.weight_layout import ShardSlice, TensorRecipe

PLAN_FORMAT = "rlfabric.reshard_plan/1"

class ReshardError(ValueError):
    """The trainer and rollout layouts do not fit the model (the message names the first bad tensor)."""


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """The tensors to send, in order, each with the shard slices composing it."""

    trainer_tp: int
    trainer_pp: int
    tensors: tuple[TensorRecipe, ...]
    dtype: str = ""  # dtype to send ("float32", "bfloat16", ...); "" keeps the trainer's

    def shards_of(self, tp_rank: int, pp_rank: int) -> list[str]:
        """Stage-local names of the shards this rank must contribute (first use order, no repeats)."""
        names = {s.name: None for r in self.tensors for s in r.sources if s.key == (tp_rank, pp_rank)}
        return list(names)

    def num_elements(self) -> int:
        total = 0
        for r in self.tensors:
            n = 1
            for d in r.hf_shape:
                n *= d
            total += n
        return total

    def to_json(self) -> bytes:
        return json.dumps({
            "format": PLAN_FORMAT,
            "trainer_tp": self.trainer_tp,
            "trainer_pp": self.trainer_pp,
            "dtype": self.dtype,
            "tensors": [_recipe_to_dict(r) for r in self.tensors],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> ReshardPlan:
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise ReshardError(f"plan is not valid JSON ({e}); build it with ReshardPlan.to_json") from e
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ReshardError(f"plan format {got!r} is not {PLAN_FORMAT!r}; build it with ReshardPlan.to_json")
        try:
            return cls(int(raw["trainer_tp"]), int(raw["trainer_pp"]),
                       tuple(_recipe_from_dict(t) for t in raw["tensors"]), str(raw.get("dtype", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ReshardError(f"plan JSON is missing or mistypes a field: {e!r}") from e


def _recipe_to_dict(r: TensorRecipe) -> dict[str, Any]:
    return {
        "name": r.hf_name, "shape": list(r.hf_shape), "concat_dim": r.concat_dim, "relay": r.relay, "layer": r.layer,
        "sources": [{"name": s.name, "tp_rank": s.tp_rank, "pp_rank": s.pp_rank, "shard_shape": list(s.shard_shape),
                     "groups": s.groups, "start": s.start, "stop": s.stop} for s in r.sources],
    }


def _recipe_from_dict(d: Mapping[str, Any]) -> TensorRecipe:
    sources = tuple(
        ShardSlice(str(s["name"]), int(s["tp_rank"]), int(s["pp_rank"]), tuple(int(n) for n in s["shard_shape"]),
                   int(s["groups"]), int(s["start"]), None if s["stop"] is None else int(s["stop"]))
        for s in d["sources"]
    )
    if not sources:
        raise ValueError(f"tensor {d['name']!r} has no sources")
    return TensorRecipe(str(d["name"]), tuple(int(n) for n in d["shape"]), sources, int(d["concat_dim"]),
                        relay=str(d.get("relay", "")), layer=d.get("layer"))
