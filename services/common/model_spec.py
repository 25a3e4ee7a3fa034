"""The architecture facts rlfabric needs from a Hugging Face config, shared by the trainer, conversion and the
resharding plan (pure Python: no torch, no Megatron).

Families: dense Qwen2 / Qwen3 / Llama, Qwen3-MoE (routed experts, softmax top-k router) and DeepSeek-V3
(multi-latent attention, `MlaSpec`; routed and shared experts with a sigmoid, group-limited router and expert
bias, `MoeSpec`; the first `first_k_dense_replace` layers dense; YaRN or plain rope, `YarnSpec`). What a family's
config.json can say that rlfabric does not build exactly as transformers does is refused here, naming the key
(DeepSeek-V3: multi-token prediction layers, a softmax router, `rope_interleave: false`, a group score that is not
the top-2 sum transformers uses, ...).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from services.common.errors import DataError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts facts of an HF config (Qwen3-MoE names): routed experts with a softmax top-k router, or
    (DeepSeek-V3) a sigmoid router with expert bias, group-limited top-k, a routed scaling factor and shared experts."""

    num_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's MLP inner dimension
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...]  # the layers whose MLP is a MoE block (others are dense, `intermediate_size`)
    router_aux_loss_coef: float  # the HF config's aux-loss coefficient (the YAML's moe_aux_loss_coeff governs training)
    score_function: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    expert_bias: bool = False  # a per-expert bias added to the scores for the choice only (`e_score_correction_bias`)
    num_groups: int | None = None  # expert groups of group-limited routing (`n_group`); None: no groups
    group_topk: int | None = None  # groups each token may choose from (`topk_group`)
    routed_scaling_factor: float | None = None  # routed experts' weights are multiplied by it; None: 1
    shared_expert_intermediate_size: int = 0  # shared experts' MLP inner size (`n_shared_experts` x expert size); 0: none


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """Multi-latent attention (DeepSeek-V2/V3, HF names): queries through a rank-`q_lora_rank` latent (or one
    projection when None), keys and values through a rank-`kv_lora_rank` latent, one rotary key shared by the heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int  # the part of a query/key head without rotary embedding
    qk_rope_head_dim: int  # the rotary part
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class YarnSpec:
    """YaRN rope scaling (DeepSeek-V3's `rope_scaling`); the attention softmax scale carries mscale_all_dim too."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The architecture facts rlfabric needs from an HF config (names follow HF's config keys)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k, v projections (Qwen2 yes; Qwen3 / Llama per config)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    rope_scaling_factor: float | None = None  # Llama-3.1 style ("llama3") scaling, else None
    moe: MoeSpec | None = None  # None: a dense model
    mla: MlaSpec | None = None  # multi-latent attention (DeepSeek-V3); None: grouped-query attention
    yarn: YarnSpec | None = None  # YaRN rope scaling (DeepSeek-V3), else None

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of the TP size (VocabParallelEmbedding needs it)."""
        return -(-self.vocab_size // tp) * tp

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads


def read_config_json(hf_dir: str | Path) -> dict[str, Any]:
    """The parsed `{hf_dir}/config.json` of a Hugging Face model folder, as written (nothing checked).

    Raises:
        DataError: naming the file when it is not there, cannot be read, or is not a JSON object.
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise DataError(f"{path}: no config.json; pass a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise DataError(f"{path}: a Hugging Face config is a JSON object, not {type(raw).__name__}")
    return raw


def read_hf_config(hf_dir: str | Path) -> tuple[ModelSpec, dict[str, Any]]:
    """Read `{hf_dir}/config.json`; return the spec and the raw config (kept for writing HF back)."""
    raw = read_config_json(hf_dir)
    return spec_from_hf_config(raw, source=str(Path(hf_dir) / "config.json")), raw


def spec_from_hf_config(raw: dict[str, Any], source: str = "config") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config dict; raise naming the key for anything unsupported."""
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "deepseek_v3":
        return _deepseek_v3_spec(raw, source)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // heads
    rope_theta = raw.get("rope_theta")
    rope_params = raw.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = rope_params.get("rope_theta", 10000.0)
    scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
    factor = None
    if scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind != "llama3":
            raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3')")
        factor = float(scaling["factor"])
    if model_type == "qwen2":
        attention_bias = True
    else:
        attention_bias = bool(raw.get("attention_bias", False))
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    return ModelSpec(
        moe=_moe_spec(raw, source) if model_type == "qwen3_moe" else None,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling_factor=factor,
    )


def _moe_spec(raw: dict[str, Any], source: str) -> MoeSpec:
    """Qwen3-MoE: layer l is a MoE layer unless listed in `mlp_only_layers`, when (l + 1) % decoder_sparse_step == 0."""
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts < 1:
        raise ValueError(f"{source}: num_experts must be at least 1 for model_type qwen3_moe")
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
    return MoeSpec(num_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=int(raw["moe_intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   moe_layers=tuple(lay for lay in range(layers) if lay not in dense and step > 0 and (lay + 1) % step == 0),
                   router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)))


def _deepseek_v3_spec(raw: dict[str, Any], source: str) -> ModelSpec:
    """DeepSeek-V3 as transformers' `DeepseekV3ForCausalLM` builds it (module docstring); refuses, naming the key,
    what rlfabric's trainer would compute differently."""

    def refuse(key: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{source}: {key}={value!r} is not supported for model_type deepseek_v3: {why}")

    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    checks = [
        ("num_nextn_predict_layers", raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0, (0,),
         "multi-token prediction layers are not trained or converted by rlfabric; set it to 0 (the main model's "
         "weights are those of the model without its MTP layers)"),
        ("hidden_act", raw.get("hidden_act", "silu"), ("silu",), "the MLPs are SwiGLU"),
        ("attention_bias", bool(raw.get("attention_bias", False)), (False,),
         "Megatron's multi-latent attention has no bias on its projections"),
        ("rope_interleave", raw.get("rope_interleave", True), (True,),
         "Megatron's multi-latent attention rotates interleaved pairs, as DeepSeek's weights are laid out"),
        ("num_key_value_heads", int(raw.get("num_key_value_heads") or heads), (heads,),
         "multi-latent attention gives every head its own key and value (num_key_value_heads = num_attention_heads)"),
        ("scoring_func", raw.get("scoring_func", "sigmoid"), ("sigmoid",), "DeepSeek-V3's router is a sigmoid"),
        ("topk_method", raw.get("topk_method", "noaux_tc"), ("noaux_tc",),
         "DeepSeek-V3 routes group-limited with the expert bias (noaux_tc)"),
        ("moe_layer_freq", raw.get("moe_layer_freq", 1), (1,),
         "transformers makes every layer from first_k_dense_replace on a MoE layer"),
        ("mlp_bias", bool(raw.get("mlp_bias", False)), (False,), "the MLPs have no bias"),
    ]
    for key, value, allowed, why in checks:
        if value not in allowed:
            raise refuse(key, value, why)
    moe = _deepseek_moe_spec(raw, source, layers, refuse)
    mla = MlaSpec(q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
                  kv_lora_rank=int(raw["kv_lora_rank"]), qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                  qk_rope_head_dim=int(raw["qk_rope_head_dim"]), v_head_dim=int(raw["v_head_dim"]))
    if mla.qk_rope_head_dim % 2:
        raise refuse("qk_rope_head_dim", mla.qk_rope_head_dim, "rotary dimensions come in pairs (an even number)")
    theta, yarn = _deepseek_rope(raw, refuse)
    return ModelSpec(
        model_type="deepseek_v3",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=mla.v_head_dim,  # Megatron's kv_channels for MLA: the attention output per head
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=False,
        qk_norm=True,  # MLA's RMSNorms on the query and key/value latents (Megatron's qk_layernorm for MLA)
        moe=moe,
        mla=mla,
        yarn=yarn,
    )


def _deepseek_moe_spec(raw: dict[str, Any], source: str, layers: int, refuse) -> MoeSpec:
    experts = int(raw.get("n_routed_experts") or 0)
    if experts < 1:
        raise refuse("n_routed_experts", raw.get("n_routed_experts"), "a DeepSeek-V3 model has routed experts")
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise refuse("num_experts_per_tok", top_k, f"must be in [1, n_routed_experts={experts}]")
    shared = int(raw.get("n_shared_experts") or 0)
    if shared < 1:
        raise refuse("n_shared_experts", raw.get("n_shared_experts"),
                     "transformers always builds the shared-expert MLP; rlfabric needs at least one shared expert")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense <= layers:
        raise refuse("first_k_dense_replace", first_dense, f"must be in [0, num_hidden_layers={layers}]")
    norm = bool(raw.get("norm_topk_prob", False))
    if norm != (top_k > 1):
        # Megatron's sigmoid router renormalises the top-k weights exactly when top-k > 1.
        raise refuse("norm_topk_prob", norm, f"with num_experts_per_tok={top_k} Megatron's sigmoid router "
                                             f"{'renormalises' if top_k > 1 else 'does not renormalise'} the weights")
    groups, group_topk = raw.get("n_group"), raw.get("topk_group")
    if groups is None or group_topk is None:
        raise refuse("n_group" if groups is None else "topk_group", None,
                     "transformers' DeepSeek-V3 router needs both n_group and topk_group")
    groups, group_topk = int(groups), int(group_topk)
    if groups < 1 or experts % groups:
        raise refuse("n_group", groups, f"must divide n_routed_experts={experts}")
    if not 1 <= group_topk <= groups:
        raise refuse("topk_group", group_topk, f"must be in [1, n_group={groups}]")
    if experts // groups < 2:
        raise refuse("n_group", groups, "transformers scores a group by its two best experts; each group needs two")
    if groups > 1 and (top_k // group_topk != 2 or top_k > group_topk * (experts // groups)):
        # transformers scores a group by its top-2 experts, Megatron by its top (topk / group_topk).
        raise refuse("topk_group", group_topk, f"Megatron scores a group by its top num_experts_per_tok / topk_group "
                                               f"experts and transformers by its top 2: num_experts_per_tok={top_k} "
                                               f"must be 2 x topk_group")
    scaling = float(raw.get("routed_scaling_factor", 1.0))
    return MoeSpec(num_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=int(raw["moe_intermediate_size"]), norm_topk_prob=norm,
                   moe_layers=tuple(range(first_dense, layers)),
                   router_aux_loss_coef=float(raw.get("aux_loss_alpha", raw.get("router_aux_loss_coef", 0.001))),
                   score_function="sigmoid", expert_bias=True,
                   # One group selects every expert: Megatron's plain top-k gives the same choice.
                   num_groups=groups if groups > 1 else None, group_topk=group_topk if groups > 1 else None,
                   routed_scaling_factor=None if scaling == 1.0 else scaling,
                   shared_expert_intermediate_size=shared * int(raw["moe_intermediate_size"]))


def _deepseek_rope(raw: dict[str, Any], refuse) -> tuple[float, YarnSpec | None]:
    """(rope_theta, YaRN or None) from `rope_parameters` (transformers 5) or `rope_scaling` (DeepSeek's releases)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise refuse(f"{key}.rope_type", kind, "only the default rope and YaRN are implemented for multi-latent "
                                               "attention (Megatron's rope and yarn)")
    for name, ok in (("attention_factor", params.get("attention_factor") is None),
                     ("truncate", params.get("truncate", True) is True),
                     ("partial_rotary_factor", float(params.get("partial_rotary_factor", 1.0)) == 1.0)):
        if not ok:
            raise refuse(f"{key}.{name}", params.get(name), "Megatron's YaRN derives it (rounded correction range, "
                                                            "whole rotary dimension)")
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if original is None:
        raise refuse(f"{key}.original_max_position_embeddings", None, "YaRN needs the pre-training context length")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(raw.get("max_position_embeddings", 4096)) / int(original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):
        if all_dim:
            raise refuse(f"{key}.mscale", mscale, "with mscale_all_dim set, transformers scales cos/sin by YaRN's "
                                                  "default factor, Megatron by mscale / mscale_all_dim; set both")
        mscale, all_dim = 1.0, 0.0  # transformers' default concentration factor, which Megatron gives for (1, 0)
    return theta, YarnSpec(factor=factor, original_max_position_embeddings=int(original),
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           mscale=float(mscale), mscale_all_dim=float(all_dim))


def check_expert_parallel(spec: ModelSpec, *, ep: int, etp: int = 1) -> None:
    """Raise naming the sizes when `ep` experts groups (each expert split over `etp` ranks) cannot hold this
    model's experts, or when ep > 1 on a dense model. The one rule for the trainer and the weight layout."""
    if ep < 1 or etp < 1:
        raise ValueError(f"expert parallel sizes must be >= 1, got expert parallel size {ep}, expert tensor "
                         f"parallel size {etp}")
    if spec.moe is None:
        if ep > 1:
            raise ValueError(f"expert parallel size {ep} needs a mixture-of-experts model; model_type "
                             f"{spec.model_type} has no experts (use expert parallel size 1)")
        return
    if spec.moe.num_experts % ep:
        raise ValueError(f"expert parallel size {ep} must divide num_experts={spec.moe.num_experts}")
    if spec.moe.moe_intermediate_size % etp:
        raise ValueError(f"expert tensor parallel size {etp} must divide moe_intermediate_size="
                         f"{spec.moe.moe_intermediate_size}")


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise naming the sizes when TP cannot split this model's attention (and MLA's latent projections, which
    Megatron's local layer spec splits by rows as well)."""
    if spec.num_key_value_heads % tp or spec.num_attention_heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide num_attention_heads={spec.num_attention_heads} "
                         f"and num_key_value_heads={spec.num_key_value_heads}")
    m = spec.mla
    if m is None:
        return
    if m.q_lora_rank is not None and m.q_lora_rank % tp:
        raise ValueError(f"tensor parallel size {tp} must divide q_lora_rank={m.q_lora_rank}")
    if (m.kv_lora_rank + m.qk_rope_head_dim) % tp:
        raise ValueError(f"tensor parallel size {tp} must divide kv_lora_rank + qk_rope_head_dim="
                         f"{m.kv_lora_rank + m.qk_rope_head_dim}")
    if spec.moe is not None and spec.moe.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the shared experts' size "
                         f"{spec.moe.shared_expert_intermediate_size}")
