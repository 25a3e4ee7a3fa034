"""A config's memory plan: per-device peaks of actor, reference and rollout in both placements, and what to change.

`inputs_from_config(cfg, device_memory)` reads what the arithmetic needs from a loaded config (the model block,
the actor / reference / rollout layouts, batch sizes, offload keys); `evaluate(inputs)` applies
services/planning/arithmetic.py and activations.py phase by phase (the inputs: services/planning/inputs.py):

- integrated (actor, reference and rollout share every device, MindSpeed-RL's all-shared-device mode, in the
  order services/coordinator/placement.py runs it): rollout = vLLM's gpu_memory_utilization x device memory +
  what the actor keeps on the device per generate_config.offload_train_*; reference pass = its weights and
  forward + the same actor residue; old log-probs = actor weights and forward (+ grads / optimizer state when
  not offloaded); update = all actor state + activations. vLLM sleeps (weights and KV cache off the device)
  outside the rollout, and the reference is offloaded outside its pass.
- disaggregated: the actor's devices (update or old log-probs, all state resident), the reference's (weights
  + forward), the rollout's (gpu_memory_utilization x device memory).

services/planning/advice.py says what to change when a placement does not fit.

Pipeline stages: each stage of a role is evaluated with the layers it holds (an even split, or the uneven one of
num_layer_list / noop_layers, services/common/pipeline_layout.py; num_layers counts no-op layers, the model
does not) and the plan takes the stage that peaks highest.

MoE models (Qwen3-MoE): the actor's expert layout is the config's (`cfg.derived.actor_expert_parallel_size`
and `actor_expert_tensor_parallel_size`), the reference's follows the same rule from its own section.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import pipeline_layout
from services.common.config.rl import RLConfig
from services.planning.activations import (
    UNFUSED,
    Kernels,
    MicroBatch,
    Recompute,
    forward_only_peak,
    stage_activations,
)
from services.planning.arithmetic import (
    DTYPE_BYTES,
    ModelShape,
    RolloutMemory,
    StateBytes,
    ceil_div,
    rank_expert_params,
    rank_params,
    rollout_memory,
    training_state,
)
from services.planning.experts import ExpertLayout, Experts
from services.planning.inputs import Offload, PlanInputs, RolloutLayout, TrainerLayout

if TYPE_CHECKING:
    from services.planning.advice import Advice

# MindSpeed-RL's per-pass budget when unset: max_packing_token_size's default, not its value.
DEFAULT_PACKING_TOKENS = RLConfig().max_packing_token_size


@dataclasses.dataclass(frozen=True)
class ActorPlan:
    """The actor's worst pipeline stage: its state and activations (bytes per device)."""

    stage: int
    n_params: int
    n_expert_params: int  # of n_params (0 for a dense model)
    state: StateBytes
    activations: dict[str, int]  # "none" / "selective" / "full": saved-for-backward peak of each recompute mode
    activations_configured: int  # the configured mode's saved peak
    logits_saved: int
    logits_transient: int
    update_peak: int
    forward_peak: int  # old log-probs: weights + forward (the state as resident then is added by placement)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    actor: int
    reference: int
    rollout: int

    @property
    def total(self) -> int:
        return self.actor + self.reference + self.rollout


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    name: str  # "integrated" or "disaggregated"
    phases: list[Phase]
    device_memory: int
    kv_fits: bool  # the rollout's KV cache holds at least one max_model_len sequence
    stage: int  # the actor pipeline stage whose devices peak highest

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_memory and self.kv_fits


@dataclasses.dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    actor: ActorPlan  # the stage where the configured placement peaks
    actor_stages: list[ActorPlan]
    reference_weights: int
    reference_forward: int
    rollout: RolloutMemory
    placements: dict[str, PlacementPlan]

    @property
    def configured(self) -> PlacementPlan:
        return self.placements["integrated" if self.inputs.integrated else "disaggregated"]


# ---- from a config -------------------------------------------------------------------------------------------


class PlanError(ValueError):
    """The config lacks something the plan needs (the message names the key)."""


def model_shape(cfg: Any) -> ModelShape:
    """The actor's model block as a ModelShape; the vocabulary from its config.json when the block lacks it."""
    a = cfg.actor_config
    block = f"model.{cfg.model_name}" if cfg.model_name else "the model block"
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if getattr(a, k) is None]
    if missing:
        raise PlanError(f"{block} sets no {', '.join(missing)}: the plan needs the model's shape")
    # The model's layers: num_layers counts MindSpeed's no-op layers, which hold nothing.
    slots = pipeline_layout.model_layer_slots(a.num_layers, a.noop_layers)
    heads = a.num_attention_heads
    vocab = a.padded_vocab_size or _hf_vocab(cfg)
    if vocab is None:
        raise PlanError(f"{block}.padded_vocab_size is unset and no config.json was found next to the tokenizer "
                        "or load path: set it")
    ffn = a.ffn_hidden_size or 4 * a.hidden_size
    return ModelShape(num_layers=len(slots), hidden=a.hidden_size, ffn=ffn,
                      heads=heads, kv_heads=a.num_query_groups if a.group_query_attention else heads,
                      head_dim=a.kv_channels or a.hidden_size // heads, vocab=vocab,
                      tied=not a.untie_embeddings_and_output_weights, qkv_bias=a.add_qkv_bias,
                      qk_norm=a.qk_layernorm, experts=_experts(a, block, ffn, slots))


def _experts(a: Any, block: str, ffn: int, slots: tuple[int, ...]) -> Experts | None:
    """The block's routed experts (Megatron's defaults: moe_ffn_hidden_size = ffn_hidden_size, every layer MoE);
    `slots`: where each model layer sits among num_layers (moe_layer_freq counts no-op layers too). DeepSeek's
    first_k_dense_replace layers are dense whatever moe_layer_freq says."""
    from services.common.config.moe import moe_layer_pattern

    if a.num_experts is None:
        return None
    pattern = moe_layer_pattern(a, a.num_layers)
    if pattern is None or len(pattern) != a.num_layers:
        raise PlanError(f"{block}.moe_layer_freq {a.moe_layer_freq!r} does not give one 0/1 entry per layer "
                        f"({a.num_layers}): the plan needs to know which layers are MoE layers")
    return Experts(num_experts=a.num_experts, ffn=a.moe_ffn_hidden_size or ffn, topk=a.moe_router_topk,
                   layers=tuple(k for k, slot in enumerate(slots) if pattern[slot]))


def _hf_vocab(cfg: Any) -> int | None:
    from services.common.config.hf_check import model_dirs
    from services.common.model_spec import read_hf_config

    a = cfg.actor_config
    for d in model_dirs(cfg):
        spec, _ = read_hf_config(d)
        div = max(a.make_vocab_size_divisible_by, 1) * a.tensor_model_parallel_size
        return ceil_div(spec.vocab_size, div) * div
    return None


def _kernels(mt: Any) -> Kernels:
    te = mt.transformer_impl == "transformer_engine"
    # The unfused softmax runs in fp32 whatever attention_softmax_in_fp32 says: megatron-core's default, which
    # rlfabric's model keeps.
    return Kernels(flash_attention=mt.use_flash_attn or te, fused_norm=mt.use_fused_rmsnorm or te,
                   fused_swiglu=mt.use_fused_swiglu, fused_rope=mt.use_fused_rotary_pos_emb)


def _recompute(mt: Any) -> Recompute:
    return Recompute(granularity=mt.recompute_granularity, method=mt.recompute_method or "uniform",
                     num_layers=mt.recompute_num_layers or 1, activation_function=mt.recompute_activation_function)


def _micro_batch(rows: int, seq: int, response: int, *, packed: bool, budget: int | None) -> MicroBatch:
    """One micro-batch at its worst (every sequence `seq` tokens long, `response` of them answers).

    `budget` (use_dynamic_bsz): as many whole sequences as the token budget holds (at least one) instead of
    `rows`. `packed` (use_remove_padding): the sequences in one row without padding, as the trainer runs them
    (THD, or one row with a block-diagonal mask on CPU, whose unfused scores then span the whole row).
    """
    if budget is not None:
        rows = max(budget // seq, 1)
    if packed:
        return MicroBatch(rows=1, seq=rows * seq, response=rows * response)
    return MicroBatch(rows=rows, seq=seq, response=response)


def inputs_from_config(cfg: Any, device_memory: int, *, cpu: bool = False) -> PlanInputs:
    """What `evaluate` needs from a loaded RLFabricConfig. `cpu`: the unfused kernels rlfabric runs on CPU."""
    a, r, rl, gen, d = cfg.actor_config, cfg.ref_config, cfg.rl_config, cfg.generate_config, cfg.derived
    shape = model_shape(cfg)
    seq, resp = d.max_sequence_length, d.max_response_length
    dyn = rl.use_dynamic_bsz

    def budget(v: int | None) -> int | None:
        return (DEFAULT_PACKING_TOKENS if v is None else v) if dyn else None

    def batch(rows: int, tokens: int | None) -> MicroBatch:
        return _micro_batch(rows, seq, resp, packed=rl.use_remove_padding, budget=budget(tokens))

    def layout(mt: Any, dp: int | None, fwd_rows: int | None, fwd_budget: int | None, update: bool,
               experts: ExpertLayout | None) -> TrainerLayout:
        kernels = UNFUSED if cpu else _kernels(mt)
        return TrainerLayout(
            tp=mt.tensor_model_parallel_size, pp=mt.pipeline_model_parallel_size, dp=dp or 1,
            params_bytes=2 if mt.bf16 else 4, distributed_optimizer=mt.use_distributed_optimizer,
            sequence_parallel=mt.sequence_parallel and mt.tensor_model_parallel_size > 1, kernels=kernels,
            recompute=_recompute(mt),
            update=batch(mt.micro_batch_size or 1, rl.update_max_packing_token_size) if update else None,
            micro_batches=(mt.pipeline_model_parallel_size if dyn else d.micro_batches_per_mini_batch or 1),
            forward=batch(fwd_rows or 1, fwd_budget), experts=experts if shape.experts is not None else None,
            tp_extend_ep=mt.moe_tp_extend_ep,
            stages=pipeline_layout.stage_layers(mt.num_layers, mt.pipeline_model_parallel_size, mt.num_layer_list,
                                                mt.noop_layers))

    actor_experts = ExpertLayout(ep=d.actor_expert_parallel_size, etp=d.actor_expert_tensor_parallel_size)
    actor = layout(a, d.actor_data_parallel_size, d.actor_forward_micro_batch_size, rl.actor_max_packing_token_size,
                   True, actor_experts)
    ref_experts = actor_experts if r is a else ExpertLayout.of(tp=r.tensor_model_parallel_size,
                                                               ep=r.expert_model_parallel_size,
                                                               tp_extend_ep=r.moe_tp_extend_ep)
    reference = layout(r, d.ref_data_parallel_size, d.ref_forward_micro_batch_size, rl.ref_max_packing_token_size,
                       False, ref_experts) if d.use_reference else None
    wbytes = DTYPE_BYTES.get(gen.dtype, actor.params_bytes)  # "auto": the model's dtype
    rollout = RolloutLayout(infer_tp=gen.infer_tensor_parallel_size, weight_bytes=wbytes,
                            gpu_memory_utilization=gen.gpu_memory_utilization, max_num_seqs=gen.max_num_seqs,
                            max_model_len=gen.max_model_len, max_num_batched_tokens=gen.max_num_batched_tokens)
    keys = {k: cfg.where(k) for k in ("use_distributed_optimizer", "recompute_granularity", "sequence_parallel",
                                        "micro_batch_size", "tensor_model_parallel_size",
                                        "pipeline_model_parallel_size", "expert_model_parallel_size")}
    for k in ("offload_train_param", "offload_train_grad", "offload_train_optimizer", "gpu_memory_utilization",
              "infer_tensor_parallel_size"):
        keys[k] = f"generate_config.{k}"
    for k in ("actor_forward_micro_batch_size", "ref_forward_micro_batch_size"):
        keys[k] = f"rl_config.{k}"
    return PlanInputs(model=shape, device_memory=device_memory, actor=actor, reference=reference, rollout=rollout,
                      integrated=rl.use_integrated_worker,
                      offload=Offload(param=gen.offload_train_param, grad=gen.offload_train_grad,
                                      optimizer=gen.offload_train_optimizer),
                      skip_old_log_probs=d.skip_old_log_probs, keys=keys, notes=tuple(_notes(cfg)))


def _notes(cfg: Any) -> list[str]:
    a = cfg.actor_config
    notes = []
    if a.reuse_fp32_param:
        notes.append("reuse_fp32_param (MindSpeed) is not modelled: the optimizer figures are an upper bound")
    if a.swap_attention or a.swap_optimizer:
        notes.append("swap_attention / swap_optimizer (Ascend) are not modelled: the figures are an upper bound")
    if a.context_parallel_size > 1:
        notes.append("context_parallel_size > 1 is not modelled: rlfabric's trainer does not split sequences")
    if a.num_experts is not None and cfg.generate_config.infer_expert_parallel_size > 1:
        notes.append(f"generate_config.infer_expert_parallel_size ({cfg.generate_config.infer_expert_parallel_size})"
                     " is inert in rlfabric: each rollout engine holds every expert, over its "
                     "infer_tensor_parallel_size ranks")
    if a.num_experts is not None:
        notes.append("MoE activations assume balanced routing (each rank's experts get the token copies it sends)")
    return notes


# ---- evaluation ----------------------------------------------------------------------------------------------


def _actor_stage(m: ModelShape, a: TrainerLayout, stage: int) -> ActorPlan:
    n = rank_params(m, tp=a.tp, pp=a.pp, stage=stage, experts=a.expert_layout, stages=a.stages)
    e = rank_expert_params(m, pp=a.pp, stage=stage, experts=a.expert_layout, stages=a.stages)
    state = training_state(n, params_bytes=a.params_bytes, distributed_optimizer=a.distributed_optimizer, dp=a.dp,
                           expert_params=e, expert_dp=a.expert_dp or 1)
    assert a.update is not None

    def acts(granularity: str | None):
        rc = dataclasses.replace(a.recompute, granularity=granularity)
        return stage_activations(m, a.update, a.shape(rc), pp=a.pp, stage=stage, micro_batches=a.micro_batches,
                                 stages=a.stages)

    mine = acts(a.recompute.granularity)
    return ActorPlan(stage=stage, n_params=n, n_expert_params=e, state=state,
                     activations={mode: acts(g).saved_peak
                                  for mode, g in (("none", None), ("selective", "selective"), ("full", "full"))},
                     activations_configured=mine.saved_peak, logits_saved=mine.logits_saved,
                     logits_transient=mine.logits_transient, update_peak=state.total + mine.peak,
                     forward_peak=forward_only_peak(m, a.forward, a.shape(), pp=a.pp, stage=stage, stages=a.stages))


def _reference(m: ModelShape, r: TrainerLayout | None) -> tuple[int, int]:
    """(weights, forward) bytes of the reference's worst stage; (0, 0) without a reference."""
    if r is None:
        return 0, 0
    return max(((rank_params(m, tp=r.tp, pp=r.pp, stage=s, experts=r.expert_layout, stages=r.stages) * r.params_bytes,
                 forward_only_peak(m, r.forward, r.shape(), pp=r.pp, stage=s, stages=r.stages)) for s in range(r.pp)),
               key=sum)


def _placements(inputs: PlanInputs, actor: ActorPlan, ref: int, budget: int, kv_fits: bool
                ) -> dict[str, PlacementPlan]:
    """Both placements for the devices of one actor pipeline stage."""
    s, off, mem = actor.state, inputs.offload, inputs.device_memory
    kept = (0 if off.param else s.params) + (0 if off.grad else s.grads) + (0 if off.optimizer else s.optimizer)
    train_only = (0 if off.grad else s.grads) + (0 if off.optimizer else s.optimizer)
    old_lp = [] if inputs.skip_old_log_probs else [Phase("old log-probs", s.params + train_only + actor.forward_peak,
                                                         0, 0)]
    ref_phase = [Phase("reference pass", kept, ref, 0)] if inputs.reference is not None else []
    integrated = [Phase("rollout", kept, 0, budget), *ref_phase, *old_lp, Phase("update", actor.update_peak, 0, 0)]
    actor_devices = max(actor.update_peak, s.total + (0 if inputs.skip_old_log_probs else actor.forward_peak))
    disagg = [Phase("actor devices", actor_devices, 0, 0)]
    if inputs.reference is not None:
        disagg.append(Phase("reference devices", 0, ref, 0))
    disagg.append(Phase("rollout devices", 0, 0, budget))
    return {"integrated": PlacementPlan("integrated", integrated, mem, kv_fits, actor.stage),
            "disaggregated": PlacementPlan("disaggregated", disagg, mem, kv_fits, actor.stage)}


def evaluate(inputs: PlanInputs) -> Plan:
    """The plan of `inputs`: each placement at the actor pipeline stage where it peaks highest."""
    m, a, ro = inputs.model, inputs.actor, inputs.rollout
    stages = [_actor_stage(m, a, s) for s in range(a.pp)]
    ref_w, ref_f = _reference(m, inputs.reference)
    rollout = rollout_memory(m, infer_tp=ro.infer_tp, weight_bytes=ro.weight_bytes, kv_bytes=ro.weight_bytes,
                             device_memory=inputs.device_memory, gpu_memory_utilization=ro.gpu_memory_utilization,
                             max_num_batched_tokens=ro.max_num_batched_tokens, max_num_seqs=ro.max_num_seqs)
    kv_fits = rollout.kv_tokens >= ro.max_model_len
    per_stage = [_placements(inputs, st, ref_w + ref_f, rollout.budget, kv_fits) for st in stages]
    placements = {name: max((p[name] for p in per_stage), key=lambda p: p.peak) for name in per_stage[0]}
    configured = placements["integrated" if inputs.integrated else "disaggregated"]
    return Plan(inputs=inputs, actor=stages[configured.stage], actor_stages=stages, reference_weights=ref_w,
                reference_forward=ref_f, rollout=rollout, placements=placements)


def plan_config(path: str | Path, device_memory: int, overrides: list[str] | tuple[str, ...] = (),
                *, cpu: bool = False) -> tuple[Plan, dict[str, Advice | None]]:
    """Load a config and plan it; raises ConfigError (refused / invalid config) or PlanError."""
    from services.common.config import load_config
    from services.planning.advice import advise

    cfg = load_config(path, overrides=list(overrides))
    inputs = inputs_from_config(cfg, device_memory, cpu=cpu)
    plan = evaluate(inputs)
    return plan, {name: advise(inputs, name) for name in plan.placements}
