"""`rlfabric plan CONFIG [-o K=V ...] [--device-memory 64GiB] [--cpu] [--json]`: predicted per-device memory.

Prints the actor's worst pipeline stage (weights, gradients, master weights, optimizer state, activations
without / with selective / with full recompute, response logits), the reference, the rollout (weights and
the KV cache vLLM has left at gpu_memory_utilization), then each placement's phases and peak, whether it
fits and which keys to change when it does not. Exit 0 when the configured placement fits, 1 when it does not,
2 when the config is refused or invalid. docs/memory.md explains the arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

EXIT_DOES_NOT_FIT = 1
EXIT_CONFIG_ERROR = 2


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="predict per-device memory of a config's actor, reference and rollout",
        description="Predict the per-device peak memory of a MindSpeed-RL config's actor, reference and rollout "
                    "in integrated and disaggregated placement; say whether it fits and what to change.")
    p.add_argument("file", metavar="CONFIG", help="the config YAML, e.g. configs/grpo_qwen25_7b_A3.yaml")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, value parsed as YAML, e.g. actor_config.micro_batch_size=1 (repeatable)")
    p.add_argument("--device-memory", default="64GiB", metavar="SIZE",
                   help="memory of one device: 64GiB (default, an Ascend A3 die), 80GB, 141G, ...")
    p.add_argument("--cpu", action="store_true",
                   help="activations as rlfabric's CPU trainer keeps them (no fused kernels) instead of the "
                        "kernels the config asks for")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from services.common.config import ConfigError
    from services.planning.arithmetic import parse_size
    from services.planning.plan import PlanError, plan_config

    try:
        device = parse_size(args.device_memory)
        plan, advice = plan_config(args.file, device, args.override, cpu=args.cpu)
    except ConfigError as exc:
        return _refused(args, [i.to_dict() for i in exc.issues], f"error: {exc}")
    except (PlanError, ValueError) as exc:
        return _refused(args, [{"message": str(exc)}], f"error: {args.file}: {exc}")
    if args.json:
        print(json.dumps(to_json(plan, advice), indent=2))
    else:
        print(render(plan, advice, args.file))
    return 0 if plan.configured.fits else EXIT_DOES_NOT_FIT


def _refused(args: argparse.Namespace, issues: list[dict], text: str) -> int:
    if args.json:
        print(json.dumps({"ok": False, "errors": issues}, indent=2))
    else:
        print(text, file=sys.stderr)
        print("rlfabric plan needs a config rlfabric accepts (check it with `rlfabric config check`)",
              file=sys.stderr)
    return EXIT_CONFIG_ERROR


def to_json(plan: Any, advice: dict[str, Any]) -> dict[str, Any]:
    """The plan as plain data: every figure in bytes."""
    i, a = plan.inputs, plan.actor
    return {
        "ok": True,
        "device_memory": i.device_memory,
        "model": {**dataclasses.asdict(i.model), "params": i.model.total_params(),
                  "active_params": i.model.total_params(active=True)},
        "actor": {"layout": dataclasses.asdict(i.actor), "stage": a.stage, "params": a.n_params,
                  "expert_params": a.n_expert_params, "expert_layout": dataclasses.asdict(i.actor.expert_layout),
                  "expert_dp": i.actor.expert_dp if i.model.experts is not None else None,
                  "stages": [dataclasses.asdict(st) for st in plan.actor_stages],
                  "weights": a.state.params, "grads": a.state.grads, "master": a.state.master,
                  "optimizer_states": a.state.optimizer_states, "optimizer": a.state.optimizer,
                  "activations": a.activations, "activations_configured": a.activations_configured,
                  "logits_saved": a.logits_saved, "logits_transient": a.logits_transient,
                  "update_peak": a.update_peak, "forward_peak": a.forward_peak},
        "reference": None if i.reference is None else {
            "layout": dataclasses.asdict(i.reference), "weights": plan.reference_weights,
            "forward": plan.reference_forward},
        "rollout": {**dataclasses.asdict(plan.rollout), "kv_tokens": plan.rollout.kv_tokens,
                    "layout": dataclasses.asdict(i.rollout)},
        "configured_placement": plan.configured.name,
        "placements": {name: {"phases": [{**dataclasses.asdict(ph), "total": ph.total} for ph in p.phases],
                              "actor_stage": p.stage, "peak": p.peak, "fits": p.fits, "kv_fits": p.kv_fits,
                              "advice": None if advice.get(name) is None else dataclasses.asdict(advice[name])}
                       for name, p in plan.placements.items()},
        "notes": list(i.notes),
    }


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def gib(n: int | float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _layout_line(a: Any, moe: bool) -> str:
    prec = "bf16 (fp32 master weights and grads)" if a.params_bytes == 2 else "fp32"
    bits = [f"TP {a.tp} x PP {a.pp} x DP {a.dp}", prec]
    if moe:
        x = a.expert_layout
        bits.insert(1, f"experts EP {x.ep} x expert-TP {x.etp}{' (moe_tp_extend_ep)' if a.tp_extend_ep else ''}"
                       f" x expert DP {a.expert_dp}")
    if a.distributed_optimizer:
        bits.append("distributed optimizer" + (" (no sharding at DP 1)" if a.dp == 1 else ""))
    if a.sequence_parallel:
        bits.append("sequence parallel")
    rc = a.recompute
    bits.append("no recompute" if rc.granularity is None else
                f"{rc.granularity} recompute" + (f" ({rc.method}, {rc.num_layers} layer(s))"
                                                 if rc.granularity == "full" else ""))
    if rc.activation_function:
        bits.append("activation-function recompute")
    return ", ".join(bits)


def _mb(mb: Any) -> str:
    if mb.rows == 1 and mb.tokens is None and mb.seq > 0:
        return f"1 x {mb.seq} tokens"
    return f"{mb.rows} x {mb.seq} tokens"


def render(plan: Any, advice: dict[str, Any], path: str) -> str:
    i, a = plan.inputs, plan.actor
    m, al = i.model, i.actor
    moe = ""
    if m.experts is not None:
        e = m.experts
        moe = (f", {_count(m.total_params(active=True))} active per token: {e.num_experts} experts of width {e.ffn}, "
               f"top-{e.topk}, in {len(e.layers)} layers")
    rows = [f"rlfabric plan {path}: {_count(m.total_params())} parameters ({m.num_layers} layers, hidden "
            f"{m.hidden}, vocabulary {m.vocab}{moe}); devices of {gib(i.device_memory)}", ""]
    where = f"pipeline stage {a.stage} of {al.pp}, where the configured placement peaks" if al.pp > 1 else "every rank"
    rows.append(f"actor      {_layout_line(al, m.experts is not None)}")
    experts = ""
    if m.experts is not None:
        experts = (f", of which {_count(a.n_expert_params)} in experts: {m.experts.num_experts // al.expert_layout.ep}"
                   f" per MoE layer{f' split over {al.expert_layout.etp}' if al.expert_layout.etp > 1 else ''}")
    rows.append(f"  per device ({where}: {_count(a.n_params)} parameters{experts})")
    s = a.state
    act = a.activations
    upd = al.update
    assert upd is not None
    configured = al.recompute.granularity or "none"
    sharded = ""
    if al.distributed_optimizer and (al.dp > 1 or (m.experts is not None and (al.expert_dp or 1) > 1)):
        sharded = ", / (expert) DP" if m.experts is not None else ", / DP"
    items = [
        ("weights", s.params),
        ("gradients (fp32)", s.grads),
        ("master weights (fp32)" + sharded, s.master),
        ("Adam moments (2 x fp32)" + sharded, s.optimizer_states),
    ]
    for label, value in items:
        rows.append(f"    {label:<44}{gib(value):>12}")
    rows.append(f"    {'activations, micro-batch ' + _mb(upd):<44}{gib(a.activations_configured):>12}"
                f"   (no recompute {gib(act['none'])}, selective {gib(act['selective'])}, full {gib(act['full'])};"
                f" configured: {configured})")
    if a.logits_saved:
        rows.append(f"    {'  of which response logits (fp32)':<44}{gib(a.logits_saved):>12}"
                    f"   (+ {gib(a.logits_transient)} transient while the loss runs)")
    rows.append(f"    {'update peak':<44}{gib(a.update_peak):>12}")
    rows.append(f"    {'old log-prob forward, ' + _mb(al.forward):<44}{gib(a.forward_peak):>12}")
    if i.reference is not None:
        r = i.reference
        rows.append(f"reference  TP {r.tp} x PP {r.pp}, {'bf16' if r.params_bytes == 2 else 'fp32'} weights "
                    f"{gib(plan.reference_weights)}, forward of {_mb(r.forward)} {gib(plan.reference_forward)}")
    ro, rm = i.rollout, plan.rollout
    seqs = rm.kv_tokens / ro.max_model_len if ro.max_model_len else 0
    rows.append(f"rollout    vLLM engine TP {ro.infer_tp}: {ro.gpu_memory_utilization:g} x {gib(i.device_memory)} = "
                f"{gib(rm.budget)}: weights {gib(rm.weights)}, activations ~{gib(rm.activations)}, KV cache "
                f"{gib(max(rm.kv_cache, 0))} = {rm.kv_tokens:,} tokens ({seqs:.1f} sequences of max_model_len "
                f"{ro.max_model_len}, max_num_seqs {ro.max_num_seqs})")
    rows.append("")
    rows.append(f"{'placement':<28}{'phase':<20}{'actor':>12}{'reference':>12}{'rollout':>12}{'per device':>12}")
    for name, p in plan.placements.items():
        label = f"{name}{' (configured)' if p is plan.configured else ''}"
        for n, ph in enumerate(p.phases):
            rows.append(f"{label if n == 0 else '':<28}{ph.name:<20}{gib(ph.actor):>12}{gib(ph.reference):>12}"
                        f"{gib(ph.rollout):>12}{gib(ph.total):>12}")
        problems = [f"{gib(p.peak - p.device_memory)} over"] if p.peak > p.device_memory else []
        if not p.kv_fits:
            problems.append(f"the KV cache holds {rm.kv_tokens:,} tokens, less than max_model_len {ro.max_model_len}")
        verdict = "fits" if p.fits else f"does NOT fit ({'; '.join(problems)})"
        rows.append(f"{'':<28}{'peak':<20}{'':>36}{gib(p.peak):>12}   {verdict}")
    for name, adv in advice.items():
        if adv is None:
            continue
        if adv.fits and adv.alternatives:
            rows.append(f"to fit {name}, set any one of: " + "; ".join(adv.settings))
        elif adv.fits:
            rows.append(f"to fit {name}: set " + " and ".join(adv.settings) + f" (peak {gib(adv.peak)})")
        else:
            tried = " and ".join(adv.settings) if adv.settings else "nothing applies"
            rows.append(f"{name} does not fit even with {tried} (peak {gib(adv.peak)}): more devices, or "
                        "devices with more memory")
    rows.extend(f"note: {n}" for n in i.notes)
    return "\n".join(rows)

