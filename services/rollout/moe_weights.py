"""Where an HF-named tensor lives among vLLM's parameters, MoE experts included (runs inside the worker).

vLLM fuses what HF keeps apart: q/k/v into `qkv_proj`, a dense MLP's gate/up into `gate_up_proj`, DeepSeek's
MLA down projections q_a_proj / kv_a_proj_with_mqa into `fused_qkv_a_proj` (all three `packed_modules_mapping`),
and the experts of a MoE layer into two parameters of its FusedMoE, `w13_weight` [E, 2I, H] (expert e: gate rows
0..I, up rows I..2I, vLLM's w1 and w3) and `w2_weight` [E, H, I] (down, w2), under a module path that need not
match HF's (`mlp.experts.routed_experts.` in vLLM 0.32). This module answers, per HF name, which parameter loading
it writes into (`target`: what a gRPC push backs up, worker_ops._Backup) and which view of it holds the tensor
(`view`: the read-back of `RolloutEngine.read_weights`). TP 1 and unpadded, unpacked layouts only (on CPU,
patches.py patch 4 keeps the experts so); anything else answers None rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# `model.layers.3.mlp.experts.17.gate_proj.weight` -> (`model.layers.3.mlp.experts.`, 17, gate_proj)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}


def expert_target(hf_name: str, params: Mapping[str, Any]) -> tuple[str, int, str] | None:
    """(vLLM parameter name, expert id, HF projection) of an HF expert tensor, or None for any other name."""
    m = _EXPERT.match(hf_name)
    if m is None:
        return None
    fused = _FUSED[m["proj"]]
    # The FusedMoE parameter under the same `...experts.` module path, however vLLM nests it below.
    found = [n for n in params if n.startswith(m["prefix"]) and n.endswith("." + fused)
             and n.count(".") - m["prefix"].count(".") <= 1]
    return (found[0], int(m["expert"]), m["proj"]) if len(found) == 1 else None


def target(hf_name: str, params: Mapping[str, Any], packed: Mapping[str, Sequence[str]]) -> str | None:
    """The vLLM parameter that loading `hf_name` writes into, or None when this mapping does not know it."""
    if hf_name in params:
        return hf_name
    expert = expert_target(hf_name, params)
    if expert is not None:
        return expert[0]
    for fused, parts in packed.items():
        for part in parts:
            name = hf_name.replace(f".{part}.", f".{fused}.")
            if name != hf_name and name in params:
                return name
    return None


def view(hf_name: str, params: Mapping[str, Any], packed: Mapping[str, Sequence[str]],
         hf_shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """The part of a vLLM parameter that holds the HF tensor `hf_name` (its full HF shape), or None."""
    shape = tuple(hf_shapes[hf_name])
    if hf_name in params:
        param = params[hf_name]
        return param if tuple(param.shape) == shape else None
    expert = expert_target(hf_name, params)
    if expert is not None:
        name, e, proj = expert
        rows = params[name][e]
        if proj != "down_proj" and rows.shape[0] != 2 * shape[0]:
            return None  # padded or packed: not the plain [gate; up] of patch 4
        if proj == "up_proj":
            rows = rows[rows.shape[0] - shape[0]:]
        elif proj == "gate_proj":
            rows = rows[:shape[0]]
        return rows if tuple(rows.shape) == shape else None
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            name = hf_name.replace(f".{part}.", f".{fused}.")
            if name == hf_name or name not in params:
                continue
            siblings = [hf_name.replace(f".{part}.", f".{p}.") for p in parts]
            if any(s not in hf_shapes for s in siblings):
                return None
            start = sum(hf_shapes[s][0] for s in siblings[:i])
            rows = params[name][start:start + shape[0]]
            return rows if tuple(rows.shape) == shape and params[name].shape[0] == sum(
                hf_shapes[s][0] for s in siblings) else None
    return None
