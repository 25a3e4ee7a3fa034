"""Megatron-core GPTModel built from a Hugging Face config (dense Qwen2 / Qwen2.5 / Qwen3 / Llama, Qwen3-MoE,
DeepSeek-V3).

Owns: turning a `ModelSpec` (services/common/model_spec.py, read from an HF `config.json`) into Megatron's TransformerConfig,
and building this rank's GPTModel (pre/post-process flags set by the pipeline stage). A MoE model's MoE fields and
expert-parallel sharding are services/trainer/moe.py's; its MoE layers use Megatron's MoELayer spec, the others the
dense MLP (per layer, as the HF config's MoE layers say: DeepSeek-V3's first_k_dense_replace layers are dense).
Multi-latent attention (DeepSeek-V3) is Megatron's MLASelfAttention with MLATransformerConfig (services/trainer/mla.py).

Choices:
- Layer spec: TransformerEngine's when TE is importable and an accelerator is present, else Megatron's
  local spec with RMSNorm (the only one that runs on CPU), its norms megatron_compat.TorchNorm (torch's,
  also under sequence parallelism). On Ascend, MindSpeed patches Megatron when imported
  (`mindspeed.megatron_adaptor`, which reads its feature switches from sys.argv then), so the same
  local/TE call sites apply.
- Pipeline stages: an even split, or the layers per stage that MindSpeed's num_layer_list / noop_layers give
  (services/common/pipeline_layout.py) as megatron-core's `pipeline_model_parallel_layout`, which sets each
  stage's layer count and its layers' model-wide numbers. No-op layers are not built: they compute nothing.
- Activation memory (recompute, sequence parallelism, swap_attention): `ActivationMemory`
  (services/trainer/activation_memory.py) into TransformerConfig and the built model; the hooks that
  sequence parallelism needs are services/trainer/sequence_parallel.py's.
- Dropout is 0 (GRPO fine-tuning; also what makes the CPU RNG tracker in megatron_compat exact).
- Fusions (bias/activation, masked softmax, RoPE, grad-accumulation) are off on CPU; on an accelerator
  Megatron's defaults are kept.
- The vocabulary is padded to a multiple of the TP size when needed; logits are sliced back to the HF
  vocabulary size by `logits_from_output` so padding never enters a softmax.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch
import torch.nn.functional as F

from services.common import pipeline_layout, weight_layout
from services.common.accelerator import npu_present
from services.common.model_spec import ModelSpec, check_expert_parallel, check_tensor_parallel
from services.trainer import activation_memory, megatron_compat, mla, moe, sequence_parallel
from services.trainer.activation_memory import ActivationMemory
from services.trainer.moe import MoeOptions

logger = logging.getLogger(__name__)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _fused_softmax_kernels() -> bool:
    """Whether Megatron's fused softmax kernels are installed (built with Megatron-LM or apex; PyPI's megatron-core
    has none). Megatron's local-spec attention asks for them whenever `masked_softmax_fusion` is on and fails on
    the import (seen on an H200 with megatron-core 0.16.1: "No module named 'scaled_masked_softmax_cuda'"), rather
    than falling back to torch's softmax; TransformerEngine's attention does not use them."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def _maybe_import_mindspeed(memory: ActivationMemory) -> None:
    # MindSpeed adapts Megatron to Ascend NPUs by patching it at import time.
    if npu_present():
        activation_memory.pass_to_mindspeed(memory)
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError:
        pass


def transformer_config(spec: ModelSpec, *, tp: int, pp: int, params_dtype: torch.dtype = torch.float32,
                       memory: ActivationMemory = ActivationMemory(), ep: int = 1, etp: int | None = None,
                       moe_opts: MoeOptions = MoeOptions(), stages: weight_layout.StageLayers | None = None,
                       deterministic: bool = False):
    """Megatron TransformerConfig for `spec` at this TP/PP (and EP / expert TP, for a MoE model; etp None: TP);
    MLATransformerConfig for multi-latent attention. `stages`: the layers of each pipeline stage (None: an even
    split; `weight_layout.stage_layer_counts`). `deterministic`: Megatron's deterministic_mode (rlfabric.deterministic:
    an embedding backward without atomics, TransformerEngine's deterministic attention)."""
    on_accel = megatron_compat.accelerator_present()
    stages = weight_layout.stage_layer_counts(spec, pp, stages)
    uneven = len(set(stages)) > 1
    check_tensor_parallel(spec, tp)
    check_expert_parallel(spec, ep=ep, etp=tp if etp is None else etp)
    return mla.config_class(spec)(
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
        deterministic_mode=deterministic,
        use_cpu_initialization=not on_accel,
        # Weights always come from a checkpoint or HF conversion, but Megatron sets the TP attributes
        # (`tensor_model_parallel`, `partition_dim`) that grad-norm and weight export rely on only in
        # its init functions (tensor_parallel/layers.py), so initialisation stays on.
        perform_initialization=True,
        bias_activation_fusion=on_accel,
        masked_softmax_fusion=on_accel and _fused_softmax_kernels(),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=on_accel,
        # Uneven stages: the config's rule (services/common/config/activations.py) bounded recompute_num_layers by
        # the stages' slots, no-op layers counted, as upstream does; the trainer runs any bound (activation_memory).
        **activation_memory.transformer_config_kwargs(memory, tp=tp, layers_per_stage=None if uneven else stages[0]),
        # megatron-core's own uneven pipeline: the decoder layers of each stage, embedding first and loss last.
        pipeline_model_parallel_layout=_pipeline_layout(stages) if uneven else None,
        **moe.transformer_config_kwargs(spec, moe_opts, ep=ep, etp=etp),
        **mla.transformer_config_kwargs(spec),
    )


def _pipeline_layout(stages: tuple[int, ...]) -> list[list[str]]:
    """megatron-core's `pipeline_model_parallel_layout` placing `stages[p]` decoder layers on stage p."""
    layout = [["decoder"] * n for n in stages]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def config_stage_layers(config) -> tuple[int, ...]:
    """The layers of each pipeline stage of a built model's TransformerConfig (the inverse of `transformer_config`'s
    layout): what weight export and checkpoints number layers by."""
    from megatron.core.transformer.enums import LayerType

    pp = config.pipeline_model_parallel_size
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return pipeline_layout.stage_slots(config.num_layers, pp)
    return tuple(stage[0].count(LayerType.decoder) for stage in layout.layout)


def layer_spec(spec: ModelSpec, memory: ActivationMemory = ActivationMemory(), *, num_experts: int | None = None):
    """TE layer spec on an accelerator with TransformerEngine, else the local (CPU-capable) spec.

    `num_experts`: a MoE layer's spec (Megatron's MoELayer, experts as SequentialMLP), else a dense layer's.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    activation_memory.note_platform_only(memory, on_ascend=npu_present())
    latent = spec.mla is not None
    if megatron_compat.accelerator_present():
        _maybe_import_mindspeed(memory)
        if _have_te():
            return mla.adapt_layer_spec(get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm,
                multi_latent_attention=latent), te=True)
    return mla.adapt_layer_spec(_with_torch_norms(get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm, normalization="RMSNorm",
        multi_latent_attention=latent)), te=False)


def _with_torch_norms(local_spec):
    """The local spec with megatron_compat.TorchNorm for its norms (WrappedTorchNorm refuses sequence parallelism)."""
    from megatron.core.transformer.identity_op import IdentityOp

    norm = megatron_compat.TorchNorm
    sub = local_spec.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, **{  # MLA's latent norms are q_layernorm and kv_layernorm
        k: norm for k in ("q_layernorm", "k_layernorm", "kv_layernorm")
        if getattr(attn.submodules, k, IdentityOp) is not IdentityOp})
    sub = dataclasses.replace(sub, input_layernorm=norm, pre_mlp_layernorm=norm,
                              self_attention=dataclasses.replace(attn, submodules=attn_sub))
    return dataclasses.replace(local_spec, submodules=sub)


def build_gpt_model(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    memory: ActivationMemory = ActivationMemory(),
    moe_opts: MoeOptions = MoeOptions(),
    stages: weight_layout.StageLayers | None = None,
    deterministic: bool = False,
):
    """This rank's GPTModel (parallel_state must be initialised; EP and expert TP are read from it), with `stages`
    layers on each pipeline stage (None: an even split). Weights are uninitialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    megatron_compat.apply_cpu_patches()
    if spec.moe is not None:
        megatron_compat.apply_moe_patches()
    config = transformer_config(spec, tp=tp, pp=pp, params_dtype=params_dtype, memory=memory,
                                ep=parallel_state.get_expert_model_parallel_world_size(),
                                etp=parallel_state.get_expert_tensor_parallel_world_size(), moe_opts=moe_opts,
                                stages=stages, deterministic=deterministic)
    # With tied embeddings and PP > 1 Megatron moves the embedding to "cuda" to all-reduce it
    # between the first and last stage (see megatron_compat.cpu_device_mode).
    with megatron_compat.cpu_device_mode():
        model = _gpt_model(GPTModel, spec, config, tp, memory)
    activation_memory.apply_to_model(model, memory)
    sequence_parallel.install(model)
    moe.install(model)
    if megatron_compat.accelerator_present():
        model = model.to(torch.cuda.current_device()) if torch.cuda.is_available() else model.to("npu")
    return model


def _gpt_model(gpt_model_class, spec: ModelSpec, config, tp: int, memory: ActivationMemory):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = layer_spec(spec, memory)
    te = megatron_compat.accelerator_present() and _have_te()
    if spec.moe is not None or not te:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        n = get_num_layers_to_build(config, pp_rank=pp_rank)
        per_layer = [layers] * n
        if spec.moe is not None:
            moe_layer = layer_spec(spec, memory, num_experts=spec.moe.num_experts)
            pattern = moe.moe_layer_pattern(spec)
            stage = [pattern[layer] for layer in pipeline_layout.stage_range(config_stage_layers(config), pp_rank)]
            per_layer = [moe_layer if is_moe else layers for is_moe in stage]
        # The block's final norm too: TransformerBlock picks WrappedTorchNorm for a bare layer spec.
        layers = TransformerBlockSubmodules(layer_specs=per_layer, layer_norm=megatron_compat.TorchNorm)
        if te:
            from megatron.core.extensions.transformer_engine import TENorm

            layers = dataclasses.replace(layers, layer_norm=TENorm)
    return gpt_model_class(
        config=config,
        transformer_layer_spec=layers,
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,  # full-vocab logits on every TP rank: log-probs need the whole softmax
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,  # MLA's rope is its own (mla.py); GPTModel builds none
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


# TransformerEngine specs fuse the pre-attention / pre-MLP norms (and MLA's latent norms) into the next linear
# layer, which renames their weights. Checkpoints and conversion always use the local spec's names.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
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
