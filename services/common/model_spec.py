"""The architecture facts rlfabric needs from a Hugging Face config, shared by the trainer, conversion and the
resharding plan (pure Python: no torch, no Megatron)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts facts of an HF config (Qwen3-MoE names): routed experts with a softmax top-k router."""

    num_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's MLP inner dimension
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...]  # the layers whose MLP is a MoE block (others are dense, `intermediate_size`)
    router_aux_loss_coef: float  # the HF config's aux-loss coefficient (the YAML's moe_aux_loss_coeff governs training)


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

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of the TP size (VocabParallelEmbedding needs it)."""
        return -(-self.vocab_size // tp) * tp

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads


def read_hf_config(hf_dir: str | Path) -> tuple[ModelSpec, dict[str, Any]]:
    """Read `{hf_dir}/config.json`; return the spec and the raw config (kept for writing HF back)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; pass a Hugging Face model folder")
    raw = json.loads(path.read_text())
    return spec_from_hf_config(raw, source=str(path)), raw


def spec_from_hf_config(raw: dict[str, Any], source: str = "config") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config dict; raise naming the key for anything unsupported."""
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
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
