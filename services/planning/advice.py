"""What to change when a placement does not fit: `advise(inputs, placement)` for `rlfabric plan`.

Tries the changes a user would make, least disruptive first (docs/memory.md lists the order), each on the
PlanInputs (services/planning/inputs.py) that services/planning/plan.py read from the config: the single changes
that make the placement fit, or else the fewest, taken in order, that do. Each names the YAML key where the config
sets it. A doubled TP or PP keeps the devices (DP halves) and, for a MoE model, a valid expert layout; a doubled
expert_model_parallel_size halves the experts a rank holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.planning.activations import Recompute
from services.planning.arithmetic import ModelShape
from services.planning.inputs import PlanInputs, TrainerLayout
from services.planning.plan import evaluate


@dataclasses.dataclass(frozen=True)
class Change:
    """One config change: the YAML setting it stands for and the inputs it produces (None: not applicable)."""

    setting: str
    apply: Callable[[PlanInputs], PlanInputs | None]


def _actor(inputs: PlanInputs, **kw: Any) -> PlanInputs:
    return dataclasses.replace(inputs, actor=dataclasses.replace(inputs.actor, **kw))


def _experts_fit(m: ModelShape, a: TrainerLayout) -> bool:
    """Megatron's and MindSpeed's conditions on an expert layout (services/common/config/moe.py)."""
    if m.experts is None:
        return True
    x = a.expert_layout
    return m.experts.num_experts % x.ep == 0 and m.experts.ffn % x.etp == 0 and a.expert_dp is not None


def _double_tp(inputs: PlanInputs) -> PlanInputs | None:
    a, m = inputs.actor, inputs.model
    tp = a.tp * 2
    if m.heads % tp or m.kv_heads % tp or a.dp % 2:
        return None
    doubled = a.with_tp(tp, a.dp // 2)
    return dataclasses.replace(inputs, actor=doubled) if _experts_fit(m, doubled) else None


def _double_pp(inputs: PlanInputs) -> PlanInputs | None:
    a, m = inputs.actor, inputs.model
    pp = a.pp * 2
    if m.num_layers % pp or a.dp % 2:
        return None
    doubled = dataclasses.replace(a, pp=pp, dp=a.dp // 2, stages=None)  # twice the stages, evenly
    return dataclasses.replace(inputs, actor=doubled) if _experts_fit(m, doubled) else None


def _double_ep(inputs: PlanInputs) -> PlanInputs | None:
    """expert_model_parallel_size doubled (at the same devices): half the experts per rank."""
    a, m = inputs.actor, inputs.model
    if m.experts is None:
        return None
    doubled = _actor(inputs, experts=dataclasses.replace(a.expert_layout, ep=a.expert_layout.ep * 2)).actor
    return dataclasses.replace(inputs, actor=doubled) if _experts_fit(m, doubled) else None


# vLLM's own default gpu_memory_utilization: what a rollout with devices of its own can take.
_VLLM_DEFAULT_UTILIZATION = 0.9


def _util_for_room(inputs: PlanInputs) -> PlanInputs | None:
    """gpu_memory_utilization set to the room there is: integrated, what the actor's kept state leaves (two
    decimals, at most vLLM's default); disaggregated, vLLM's default. None when that is the current value."""
    util = _VLLM_DEFAULT_UTILIZATION
    if inputs.integrated:
        kept = evaluate(inputs).placements["integrated"].phases[0].actor
        util = min(util, int((inputs.device_memory - kept) / inputs.device_memory * 100) / 100)
    if util <= 0 or util == inputs.rollout.gpu_memory_utilization:
        return None
    return dataclasses.replace(inputs, rollout=dataclasses.replace(inputs.rollout, gpu_memory_utilization=util))


def _infer_tp_ok(m: ModelShape, tp: int) -> bool:
    # vLLM splits query heads evenly and splits or replicates KV heads; it splits each expert's MLP over TP, or
    # (enable_expert_parallel) places num_experts / TP whole experts on each rank.
    experts_ok = m.experts is None or (m.experts.ffn % tp == 0 and m.experts.num_experts % tp == 0)
    return m.heads % tp == 0 and (m.kv_heads % tp == 0 or tp % m.kv_heads == 0) and experts_ok


def _smaller_forward(layout: TrainerLayout | None) -> TrainerLayout | None:
    if layout is None or layout.forward.rows <= 1:
        return None
    return dataclasses.replace(layout, forward=dataclasses.replace(layout.forward, rows=1))


def changes(inputs: PlanInputs) -> list[Change]:
    """The changes to try, least disruptive first (each returns None where it does not apply)."""
    k, a, ro = inputs.keys, inputs.actor, inputs.rollout
    out = [Change(f"{k.get('use_distributed_optimizer')}: true",
                  lambda i: _actor(i, distributed_optimizer=True)
                  if not i.actor.distributed_optimizer and i.actor.dp > 1 else None)]
    if inputs.integrated:
        for name, field in (("offload_train_optimizer", "optimizer"), ("offload_train_grad", "grad"),
                            ("offload_train_param", "param")):
            out.append(Change(f"{k.get(name)}: true", lambda i, f=field: None if getattr(i.offload, f) else
                              dataclasses.replace(i, offload=dataclasses.replace(i.offload, **{f: True}))))
    out += [
        Change(f"{k.get('recompute_granularity')}: full", lambda i: None if i.actor.recompute.granularity == "full"
               else _actor(i, recompute=Recompute("full", "uniform", 1, i.actor.recompute.activation_function))),
        Change(f"{k.get('sequence_parallel')}: true", lambda i: _actor(i, sequence_parallel=True)
               if i.actor.tp > 1 and not i.actor.sequence_parallel else None),
        Change(f"{k.get('micro_batch_size')}: 1",
               lambda i: None if i.actor.update is None or i.actor.update.rows <= 1
               else _actor(i, update=dataclasses.replace(i.actor.update, rows=1))),
        Change(f"{k.get('actor_forward_micro_batch_size')}: 1",
               lambda i: None if (f := _smaller_forward(i.actor)) is None else dataclasses.replace(i, actor=f)),
        Change(f"{k.get('ref_forward_micro_batch_size')}: 1",
               lambda i: None if (f := _smaller_forward(i.reference)) is None else dataclasses.replace(i, reference=f)),
    ]
    out += [
        Change(f"{k.get('gpu_memory_utilization')}: ?", _util_for_room),
        Change(f"{k.get('infer_tensor_parallel_size')}: {ro.infer_tp * 2}",
               lambda i: dataclasses.replace(i, rollout=dataclasses.replace(i.rollout, infer_tp=ro.infer_tp * 2))
               if _infer_tp_ok(i.model, ro.infer_tp * 2) else None),
        Change(f"{k.get('expert_model_parallel_size')}: {_yaml_ep(a) * 2}", _double_ep),
        Change(f"{k.get('tensor_model_parallel_size')}: {a.tp * 2}", _double_tp),
        Change(f"{k.get('pipeline_model_parallel_size')}: {a.pp * 2}", _double_pp),
    ]
    return out


def _yaml_ep(a: TrainerLayout) -> int:
    """The YAML's expert_model_parallel_size of a layout (megatron-core's EP / TP under moe_tp_extend_ep)."""
    ep = a.expert_layout.ep
    return ep // a.tp if a.tp_extend_ep else ep


@dataclasses.dataclass(frozen=True)
class Advice:
    placement: str
    fits: bool  # whether `settings` make it fit
    settings: list[str]
    peak: int  # the placement's lowest peak with a fitting setting, or with all of `settings` applied
    alternatives: bool  # each setting fits alone (else: all of them together, in order)


def _setting(change: Change, applied: PlanInputs) -> str:
    if change.setting.endswith(": ?"):  # name the value the change chose
        return change.setting.replace("?", f"{applied.rollout.gpu_memory_utilization:g}")
    return change.setting


def advise(inputs: PlanInputs, placement: str) -> Advice | None:
    """None when `placement` fits; else the single changes that make it fit, or the fewest in order that do."""
    if evaluate(inputs).placements[placement].fits:
        return None
    singles = []
    for c in changes(inputs):
        applied = c.apply(inputs)
        if applied is not None and (p := evaluate(applied).placements[placement]).fits:
            singles.append((_setting(c, applied), p.peak))
    if singles:
        best = min(singles, key=lambda s: s[1])
        return Advice(placement, True, [s for s, _ in singles], best[1], alternatives=True)
    # Greedy: take the first change (in order) that lowers the peak or makes the KV cache fit, until it fits.
    current, taken = inputs, []
    candidates = changes(inputs)
    progress = True
    while progress:
        progress = False
        before = evaluate(current).placements[placement]
        for c in candidates:
            label = c.setting.split(":")[0]
            if any(t.split(":")[0] == label for t in taken) or (applied := c.apply(current)) is None:
                continue
            after = evaluate(applied).placements[placement]
            if after.peak < before.peak or (after.kv_fits and not before.kv_fits):
                current, taken, progress = applied, [*taken, _setting(c, applied)], True
                if after.fits:
                    return Advice(placement, True, taken, after.peak, alternatives=False)
                break
    return Advice(placement, False, taken, evaluate(current).placements[placement].peak, alternatives=False)
