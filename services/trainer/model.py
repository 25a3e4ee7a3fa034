"""Megatron-core GPTModel built from a Hugging Face config (dense Qwen2 / Qwen2.5 / Qwen3 / Llama).

Owns: reading an HF `config.json` into a `ModelSpec`, turning it into Megatron's TransformerConfig,
and building this rank's GPTModel (pre/post-process flags set by the pipeline stage).

Choices:
- Layer spec: TransformerEngine's when TE is importable and an accelerator is present, else Megatron's
  local spec with RMSNorm (the only one that runs on CPU). On Ascend, MindSpeed patches Megatron when
  imported (`mindspeed.megatron_adaptor`), so the same local/TE call sites apply.
- Dropout is 0 (GRPO fine-tuning; also what makes the CPU RNG tracker in megatron_compat exact).
- Fusions (bias/activation, masked softmax, RoPE, grad-accumulation) are off on CPU; on an accelerator
  Megatron's defaults are kept.
- The vocabulary is padded to a multiple of the TP size when needed; logits are sliced back to the HF
  vocabulary size by `logits_from_output` so padding never enters a softmax.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.trainer import megatron_compat

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


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
        qk_norm=model_type == "qwen3",
        rope_scaling_factor=factor,
    )


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _maybe_import_mindspeed() -> None:
    # MindSpeed adapts Megatron to Ascend NPUs by patching it at import time.
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError:
        pass


def transformer_config(spec: ModelSpec, *, tp: int, pp: int, params_dtype: torch.dtype = torch.float32):
    """Megatron TransformerConfig for `spec` at this TP/PP."""
    from megatron.core.transformer import TransformerConfig

    on_accel = megatron_compat.accelerator_present()
    if spec.num_hidden_layers % pp:
        raise ValueError(
            f"num_hidden_layers={spec.num_hidden_layers} is not divisible by pipeline_model_parallel_size={pp}"
        )
    if spec.num_key_value_heads % tp or spec.num_attention_heads % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} must divide num_attention_heads={spec.num_attention_heads} "
            f"and num_key_value_heads={spec.num_key_value_heads}"
        )
    return TransformerConfig(
        num_layers=spec.num_hidden_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.attention_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not on_accel,
        # Weights always come from a checkpoint or HF conversion, but Megatron sets the TP attributes
        # (`tensor_model_parallel`, `partition_dim`) that grad-norm and weight export rely on only in
        # its init functions (tensor_parallel/layers.py), so initialisation stays on.
        perform_initialization=True,
        bias_activation_fusion=on_accel,
        masked_softmax_fusion=on_accel,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=on_accel,
        sequence_parallel=False,
    )


def layer_spec(spec: ModelSpec):
    """TE layer spec on an accelerator with TransformerEngine, else the local (CPU-capable) spec."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if megatron_compat.accelerator_present():
        _maybe_import_mindspeed()
        if _have_te():
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    return get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")


def build_gpt_model(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
):
    """This rank's GPTModel (parallel_state must be initialised). Weights are uninitialised."""
    from megatron.core.models.gpt import GPTModel

    megatron_compat.apply_cpu_patches()
    config = transformer_config(spec, tp=tp, pp=pp, params_dtype=params_dtype)
    # With tied embeddings and PP > 1 Megatron moves the embedding to "cuda" to all-reduce it
    # between the first and last stage (see megatron_compat.cpu_device_mode).
    with megatron_compat.cpu_device_mode():
        model = _gpt_model(GPTModel, spec, config, tp)
    if megatron_compat.accelerator_present():
        model = model.to(torch.cuda.current_device()) if torch.cuda.is_available() else model.to("npu")
    return model


def _gpt_model(GPTModel, spec: ModelSpec, config, tp: int):
    from megatron.core import parallel_state

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,  # full-vocab logits on every TP rank: log-probs need the whole softmax
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's attention mask: bool [1, 1, s, s], True where attention is NOT allowed.

    Passed explicitly because GPTModel's default mask is built on "cuda" (see megatron_compat).
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def model_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run GPTModel on [b, s] token ids; returns logits [b, s, vocab] (last stage) or hidden states."""
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=causal_mask(s, input_ids.device))


# TransformerEngine specs fuse the pre-attention / pre-MLP norms into the next linear layer, which
# renames their weights. Checkpoints and conversion always use the local spec's names.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def canonical_name(name: str) -> str:
    """The local-spec name of a parameter (TE's fused-norm names mapped back)."""
    for local, te in _TE_NORM_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def canonical_state_dict(model) -> dict:
    """State dict with local-spec names and without `_extra_state` entries."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
