"""Rules of the mixture-of-experts keys (Qwen3-MoE, DeepSeek-V3) as Megatron and MindSpeed apply them.

Expert layout (the actor's, and the reference's when `ref_config` gives it its own):
- Megatron refuses expert parallelism without experts (`num_experts`), an EP that does not divide
  num_experts, and an expert layout that does not fill the devices: EP x expert-TP x PP must divide them,
  which with the expert-TP of TP means EP divides DP x CP;
- MindSpeed's `moe_tp_extend_ep` keeps experts whole and lets the TP group extend expert parallelism (EP x
  TP ranks share the experts, expert-TP 1: the same device condition); its feature refuses a num_experts
  not divisible by TP x EP, and asks for `moe_grouped_gemm` and `moe_permutation_async_comm` with it.

Values: the router's top-k must lie in [1, num_experts]; the aux-loss coefficient must be >= 0; the
load-balancing types and token dispatchers are those upstream names that rlfabric's trainer runs (Sinkhorn
routing is not among them); a group-limited router needs both group keys with groups that divide the
experts, expert bias needs the sigmoid score (Megatron's checks), and TP must divide MLA's latent projections,
which Megatron's layer spec splits by rows. The model block's own facts (experts, top-k, expert size,
norm_topk_prob, MoE layers) are compared with the config.json the model is built from (hf_check.py).

DeepSeek-V3 (`architecture_mismatches`, part of hf_check's comparison): `multi_latent_attention` and the MLA sizes
(`q_lora_rank`: unset is one query projection, as upstream; the others when written), the router
(`moe_router_score_function`, `moe_router_enable_expert_bias`, group-limited routing `moe_router_num_groups` /
`moe_router_group_topk`, `moe_router_topk_scaling_factor`: unset is 1), `n_shared_experts` (unset: none) and YaRN's
keys when `rope_scaling_type` is yarn. A Qwen3-MoE config.json meets the same keys at their defaults. The MoE
layers (`moe_layer_pattern`) are Megatron's `moe_layer_freq` with the first `first_k_dense_replace` layers dense,
as MindSpeed-LLM's DeepSeek layer spec builds them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from services.common.config.problems import Problem

if TYPE_CHECKING:
    from services.common.config.architecture import ModelConfig
    from services.common.config.megatron import MegatronConfig
    from services.common.config.resolved import RLFabricConfig
    from services.common.model_spec import ModelSpec

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "alltoall_seq")


def _sections(cfg: RLFabricConfig) -> Iterator[tuple[str, MegatronConfig, int | None]]:
    """(key prefix, Megatron section, its DP x CP) of the actor, and of the reference when it has its own."""
    d = cfg.derived
    a = cfg.actor_config
    dp = d.actor_data_parallel_size
    yield "", a, None if dp is None else dp * a.context_parallel_size
    if cfg.ref_config is not a and d.ref_data_parallel_size is not None:
        r = cfg.ref_config
        yield "ref_config.", r, d.ref_data_parallel_size * r.context_parallel_size


def moe_rules(cfg: RLFabricConfig) -> Iterable[Problem]:
    for prefix, mt, dp_cp in _sections(cfg):
        yield from _layout(prefix, mt, dp_cp)
    yield from _values(cfg.actor_config)


def _layout(prefix: str, mt: MegatronConfig, dp_cp: int | None) -> Iterable[Problem]:
    ep, tp, experts = mt.expert_model_parallel_size, mt.tensor_model_parallel_size, mt.num_experts
    key = f"{prefix}expert_model_parallel_size"
    if ep < 1 or tp < 1:
        return  # positive_sizes reports these
    if experts is None:
        if ep > 1:
            yield Problem((key,), f"{prefix}expert_model_parallel_size is {ep} but the model has no experts "
                                  f"(num_experts unset: a dense model); remove it or set it to 1")
        if mt.moe_tp_extend_ep:
            yield Problem((f"{prefix}moe_tp_extend_ep",), f"{prefix}moe_tp_extend_ep is true but the model has no "
                                                          f"experts (num_experts unset: a dense model); remove it")
        return
    if mt.moe_tp_extend_ep:
        if experts % (tp * ep):
            yield Problem((key, f"{prefix}moe_tp_extend_ep"),
                          f"num_experts ({experts}) must be divisible by tensor_model_parallel_size x "
                          f"expert_model_parallel_size ({tp} x {ep} = {tp * ep}) with moe_tp_extend_ep, which "
                          f"places whole experts on the TP ranks as well (MindSpeed's rule); choose an EP that "
                          f"divides {experts // tp if experts % tp == 0 else experts}")
        missing = [k for k in ("moe_grouped_gemm", "moe_permutation_async_comm") if not getattr(mt, k)]
        if missing:
            yield Problem((f"{prefix}moe_tp_extend_ep", *(prefix + k for k in missing)),
                          f"moe_tp_extend_ep needs {' and '.join(missing)} set to true, as MindSpeed requires; "
                          f"set {'them' if len(missing) > 1 else 'it'} or remove moe_tp_extend_ep")
    elif experts % ep:
        yield Problem((key,), f"{prefix}expert_model_parallel_size ({ep}) must divide num_experts ({experts}): each "
                              f"expert-parallel rank holds num_experts / EP whole experts")
    if dp_cp is not None and dp_cp % ep:
        yield Problem((key,),
                      f"{prefix}expert_model_parallel_size ({ep}) must divide the data-parallel x context-parallel "
                      f"size ({dp_cp}), as Megatron requires: EP x TP x PP ranks hold one copy of the experts and "
                      f"those copies must fill the devices; choose an EP that divides {dp_cp}")


def _values(a: MegatronConfig) -> Iterable[Problem]:
    if a.num_experts is None:
        return
    if a.num_experts < 1:
        yield Problem(("num_experts",), f"num_experts must be at least 1 (or unset for a dense model), "
                                        f"got {a.num_experts}")
        return
    if not 1 <= a.moe_router_topk <= a.num_experts:
        yield Problem(("moe_router_topk", "num_experts"),
                      f"moe_router_topk ({a.moe_router_topk}) must be between 1 and num_experts ({a.num_experts})")
    if a.moe_aux_loss_coeff < 0:
        yield Problem(("moe_aux_loss_coeff",), f"moe_aux_loss_coeff must be >= 0, got {a.moe_aux_loss_coeff}")
    if a.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        yield Problem(("moe_router_load_balancing_type",),
                      f"unsupported moe_router_load_balancing_type `{a.moe_router_load_balancing_type}`; supported: "
                      f"{', '.join(LOAD_BALANCING_TYPES)} (Sinkhorn routing is not implemented by rlfabric's trainer)")
    if a.moe_token_dispatcher_type is not None and a.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
        yield Problem(("moe_token_dispatcher_type",),
                      f"unsupported moe_token_dispatcher_type `{a.moe_token_dispatcher_type}`; supported: "
                      f"{', '.join(TOKEN_DISPATCHERS)} (or unset: allgather)")
    yield from _deepseek_values(a)


SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _deepseek_values(a: MegatronConfig) -> Iterable[Problem]:
    if a.moe_router_score_function not in SCORE_FUNCTIONS:
        yield Problem(("moe_router_score_function",), f"unsupported moe_router_score_function "
                                                      f"`{a.moe_router_score_function}`; supported: softmax, sigmoid")
    elif a.moe_router_enable_expert_bias and a.moe_router_score_function != "sigmoid":
        yield Problem(("moe_router_enable_expert_bias", "moe_router_score_function"),
                      "moe_router_enable_expert_bias needs moe_router_score_function: sigmoid (Megatron's rule: the "
                      "expert bias is added to sigmoid scores)")
    groups, group_topk = a.moe_router_num_groups, a.moe_router_group_topk
    if group_topk is not None:
        if not groups:
            yield Problem(("moe_router_group_topk", "moe_router_num_groups"),
                          "moe_router_group_topk needs moe_router_num_groups (group-limited routing, Megatron's rule)")
        elif a.num_experts % groups:
            yield Problem(("moe_router_num_groups", "num_experts"), f"moe_router_num_groups ({groups}) must divide "
                                                                    f"num_experts ({a.num_experts})")
        elif not 1 <= group_topk <= groups:
            yield Problem(("moe_router_group_topk", "moe_router_num_groups"),
                          f"moe_router_group_topk ({group_topk}) must be between 1 and moe_router_num_groups ({groups})")
    tp = a.tensor_model_parallel_size
    if a.multi_latent_attention and tp > 1:
        kv = None if a.kv_lora_rank is None or a.qk_pos_emb_head_dim is None else a.kv_lora_rank + a.qk_pos_emb_head_dim
        for keys, what, size in ((("q_lora_rank",), "q_lora_rank", a.q_lora_rank),
                                 (("kv_lora_rank", "qk_pos_emb_head_dim"), "kv_lora_rank + qk_pos_emb_head_dim", kv)):
            if size is not None and size % tp:
                yield Problem((*keys, "tensor_model_parallel_size"),
                              f"tensor_model_parallel_size ({tp}) must divide {what} ({size}): Megatron's MLA layer "
                              f"splits its down projections by rows over TP")


def moe_layer_pattern(a: ModelConfig, num_layers: int) -> list[int] | None:
    """One 0/1 entry per layer (1: MoE): Megatron's `moe_layer_freq` with the first `first_k_dense_replace` layers
    dense; None when moe_layer_freq cannot be read."""
    from services.common.config.hf_check import megatron_moe_layers

    pattern = megatron_moe_layers(a.moe_layer_freq, num_layers)
    if pattern is None or not a.first_k_dense_replace:
        return pattern
    return [0 if i < a.first_k_dense_replace else v for i, v in enumerate(pattern)]


def architecture_mismatches(a: ModelConfig, spec: ModelSpec) -> Iterable[tuple[str, Any, str, Any]]:
    """(key, the block's value, config.json key, its value) for each DeepSeek-V3 key the block has otherwise than
    `spec` (module docstring); the MoE keys only for a MoE block on a MoE config.json (hf_check says the rest)."""
    m, moe, y = spec.mla, spec.moe, spec.yarn
    if a.multi_latent_attention != (m is not None):
        yield ("multi_latent_attention", a.multi_latent_attention, "model_type",
               f"{spec.model_type} ({'multi-latent' if m else 'grouped-query'} attention)")
    if m is not None and a.multi_latent_attention:
        yield from _differ([("q_lora_rank", a.q_lora_rank, "q_lora_rank", m.q_lora_rank)])
        yield from _differ([row for row in (
            ("kv_lora_rank", a.kv_lora_rank, "kv_lora_rank", m.kv_lora_rank),
            ("qk_head_dim", a.qk_head_dim, "qk_nope_head_dim", m.qk_nope_head_dim),
            ("qk_pos_emb_head_dim", a.qk_pos_emb_head_dim, "qk_rope_head_dim", m.qk_rope_head_dim),
            ("v_head_dim", a.v_head_dim, "v_head_dim", m.v_head_dim)) if row[1] is not None])
    if y is not None and a.rope_scaling_type == "yarn":
        yield from _differ([
            ("beta_fast", float(a.beta_fast), "rope_scaling.beta_fast", y.beta_fast),
            ("beta_slow", float(a.beta_slow), "rope_scaling.beta_slow", y.beta_slow),
            ("rope_scaling_mscale", a.rope_scaling_mscale, "rope_scaling.mscale", y.mscale),
            ("rope_scaling_mscale_all_dim", a.rope_scaling_mscale_all_dim, "rope_scaling.mscale_all_dim",
             y.mscale_all_dim),
            ("rope_scaling_original_max_position_embeddings", a.rope_scaling_original_max_position_embeddings,
             "rope_scaling.original_max_position_embeddings", y.original_max_position_embeddings)])
    if moe is None or a.num_experts is None:
        return
    yield from _differ([
        ("moe_router_score_function", a.moe_router_score_function, "router score", moe.score_function),
        ("moe_router_enable_expert_bias", a.moe_router_enable_expert_bias, "e_score_correction_bias (router bias)",
         moe.expert_bias),
        ("n_shared_experts", a.n_shared_experts or 0, "n_shared_experts",
         moe.shared_expert_intermediate_size // moe.moe_intermediate_size),
        ("moe_router_topk_scaling_factor", a.moe_router_topk_scaling_factor or 1.0, "routed_scaling_factor",
         moe.routed_scaling_factor or 1.0),
    ])
    # One group of every expert is no group limit, in Megatron and in transformers.
    groups = a.moe_router_num_groups if a.moe_router_group_topk and (a.moe_router_num_groups or 0) > 1 else None
    if groups is None and moe.num_groups is not None:
        yield ("moe_router_group_topk", "unset (no group-limited routing)" if a.moe_router_group_topk is None else
               f"{a.moe_router_group_topk} of {a.moe_router_num_groups} group(s) (no group limit)", "topk_group",
               f"{moe.group_topk} of n_group {moe.num_groups}")
    elif groups is not None:
        yield from _differ([("moe_router_num_groups", groups, "n_group", moe.num_groups or 1),
                            ("moe_router_group_topk", a.moe_router_group_topk, "topk_group", moe.group_topk or 1)])


def _differ(rows: list[tuple[str, Any, str, Any]]) -> Iterator[tuple[str, Any, str, Any]]:
    return (row for row in rows if row[1] != row[3])
