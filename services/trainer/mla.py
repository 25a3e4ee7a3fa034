"""Multi-latent attention (DeepSeek-V3) on megatron-core's MLASelfAttention: config fields and the layer spec.

Owns what the trainer adds for a `ModelSpec` with `spec.mla` (services/common/model_spec.py):
- `transformer_config_kwargs`: MLATransformerConfig's fields. Rope is Megatron's "rope" (plain) or "yarn" with
  the HF config's factor, original context, beta fast/slow and mscale / mscale_all_dim (model_spec maps
  transformers' defaults onto Megatron's). Megatron's MLA rotates interleaved pairs (rope_utils de-interleaves
  when `multi_latent_attention`), which is transformers' `rope_interleave: true`; its softmax scale is
  mscale(factor, mscale_all_dim)^2 / sqrt(q head dim), transformers' `yarn_apply_mscale` (1 for plain rope).
- `adapt_layer_spec`: the MLA layer spec made to run on a CPU and to keep one weight layout. The local spec's
  core attention, DotProductAttention, takes no `k_channels` / `v_channels` (MLA passes them): `MlaDotProductAttention`
  accepts and drops them (queries/keys of qk head dim, values of v head dim work as they are, with
  kv_channels = v_head_dim sizing the output). With TransformerEngine the down projections are
  TEColumnParallelLinear, as the local spec's ColumnParallelLinear: split by rows over TP (TE's default,
  TELinear, keeps them whole), so a checkpoint's layout does not depend on the platform.
"""

from __future__ import annotations

import dataclasses
import functools

from services.common.model_spec import ModelSpec


def transformer_config_kwargs(spec: ModelSpec) -> dict:
    """MLATransformerConfig's fields for `spec` ({} without multi-latent attention)."""
    m = spec.mla
    if m is None:
        return {}
    out = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
               qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
               rotary_base=spec.rope_theta, rotary_percent=1.0)
    y = spec.yarn
    if y is None:
        # rotary_scaling_factor also enters the softmax scale, as mscale(factor, mscale_all_dim): 1 with all_dim 0.
        out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        out.update(rope_type="yarn", rotary_scaling_factor=y.factor,
                   original_max_position_embeddings=y.original_max_position_embeddings, beta_fast=y.beta_fast,
                   beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return out


def config_class(spec: ModelSpec):
    """Megatron's config class for `spec`: MLATransformerConfig with multi-latent attention, else TransformerConfig."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig if spec.mla is not None else TransformerConfig


@functools.cache
def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MlaDotProductAttention(DotProductAttention):
        """Megatron's unfused attention, taking MLA's head sizes (which it does not need) as keyword arguments."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)

    return MlaDotProductAttention


def _without_transformer_engine() -> None:
    # megatron-core 0.16.1 multi_latent_attention.py sets HAVE_TE when its imports of
    # megatron.core.extensions.transformer_engine succeed, which they do without TransformerEngine (that module
    # then binds TELinear = None), and MultiLatentAttention.__init__ calls isinstance(linear_proj, TELinear)
    # under HAVE_TE: a TypeError on every host without TransformerEngine. Its HAVE_TE is what TE's presence says.
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        multi_latent_attention.HAVE_TE = False


def adapt_layer_spec(layer_spec, *, te: bool):
    """`layer_spec` (an MLA layer from get_gpt_layer_*_spec(multi_latent_attention=True)) as the module docstring
    says; any other layer spec unchanged."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    attn = layer_spec.submodules.self_attention
    if attn.module is not MLASelfAttention:
        return layer_spec
    _without_transformer_engine()
    sub = attn.submodules
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        sub = dataclasses.replace(sub, linear_q_down_proj=TEColumnParallelLinear,
                                  linear_kv_down_proj=TEColumnParallelLinear)
    else:
        sub = dataclasses.replace(sub, core_attention=_dot_product_attention())
    attn = dataclasses.replace(attn, submodules=sub)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))
