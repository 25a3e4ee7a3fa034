"""`ModelConfig`: the architecture keys of one block in `configs/model/<name>.yaml` (Megatron names).

rlfabric builds the model from the Hugging Face `config.json` it loads, never from these keys, so each
key is either compared with that file (`hf_check.py`, at `config check` and `rlfabric up`), refused, or
inert with the reason. Mixture-of-experts keys describe a Qwen3-MoE model (routed experts, softmax top-k
router) or a DeepSeek-V3 model (multi-latent attention, shared experts, sigmoid group-limited router with
expert bias, dense first layers, YaRN rope), whose keys moe.py compares with a DeepSeek-V3 config.json; the
trainer's MoE training keys are checked in moe.py. Defaults follow MindSpeed-RL's `MegatronConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config.schema import read, refused, setting
from services.common.config.statuses import (
    ACTIVATIONS,
    DERIVED,
    FROM_HF,
    HF_CHECK,
    MOE_RULES,
    TRAINER_OPTIONS,
    VALIDATION,
)

_Layers = int | str | list[int] | None  # Megatron accepts "4,4,4", a list, or a pattern string.
_NO_DROPOUT = refused("rlfabric trains without dropout, as every MindSpeed-RL RL config does (0.0); the "
                      "default 0.1 would train with dropout upstream", allowed=(0.0,))


_HF_MOE = read(HF_CHECK, MOE_RULES, note="compared with the Qwen3-MoE or DeepSeek-V3 config.json the model is built "
                                         "from")
# DeepSeek-V3's keys (moe.py: architecture_mismatches): compared with the config.json, like every architecture key.
_DEEPSEEK = read(MOE_RULES, note="compared with the DeepSeek-V3 config.json the model is built from")
_YARN = read(MOE_RULES, note="YaRN rope (DeepSeek-V3): compared with the config.json's rope_scaling when "
                             "rope_scaling_type is yarn")


@dataclass(kw_only=True)
class ModelConfig:
    """Model architecture: the keys of one block in `configs/model/<name>.yaml`."""

    num_layers: int | None = setting(None, "Number of transformer layers.",
                                     read(HF_CHECK, VALIDATION, ACTIVATIONS, TRAINER_OPTIONS))
    hidden_size: int | None = setting(None, "Hidden (model) dimension.", read(HF_CHECK, DERIVED))
    ffn_hidden_size: int | None = setting(None, "MLP inner dimension (per gate for SwiGLU).", read(HF_CHECK))
    num_attention_heads: int | None = setting(None, "Number of query heads.", read(HF_CHECK, VALIDATION))
    kv_channels: int | None = setting(None, "Head dimension; unset means hidden_size / num_attention_heads.",
                                      read(HF_CHECK, DERIVED))
    group_query_attention: bool = setting(False, "Use grouped-query attention (num_query_groups KV heads).",
                                          read(HF_CHECK, DERIVED))
    num_query_groups: int = setting(1, "Number of key/value heads when group_query_attention is true.",
                                    read(HF_CHECK, VALIDATION))
    max_position_embeddings: int | None = setting(None, "Longest position the model was built for.", read(HF_CHECK))
    position_embedding_type: str = setting("learned_absolute", "Position embedding: rope, learned_absolute or none.",
                                           read(HF_CHECK))
    use_rotary_position_embeddings: bool = setting(False, "Legacy switch for rotary embeddings.", FROM_HF)
    rotary_base: int | float = setting(10000, "RoPE base (theta).", read(HF_CHECK))
    rope_scaling_type: str | None = setting(None, "RoPE scaling variant (llama3, yarn, ...); unset means none.",
                                            read(HF_CHECK))
    rope_scaling_factor: float = setting(1.0, "RoPE scaling factor.", read(HF_CHECK))
    low_freq_factor: float | None = setting(None, "Llama3 RoPE scaling: low-frequency factor.", FROM_HF)
    high_freq_factor: float | None = setting(None, "Llama3 RoPE scaling: high-frequency factor.", FROM_HF)
    original_max_position_embeddings: int | None = setting(None, "Context length before RoPE scaling.", FROM_HF)
    beta_fast: int | float = setting(32, "YaRN RoPE: beta fast.", _YARN)
    beta_slow: int | float = setting(1, "YaRN RoPE: beta slow.", _YARN)
    rope_scaling_mscale: float = setting(1.0, "YaRN RoPE: mscale.", _YARN)
    rope_scaling_mscale_all_dim: float = setting(0.0, "YaRN RoPE: mscale for all dimensions.", _YARN)
    rope_scaling_original_max_position_embeddings: int | None = setting(
        None, "YaRN RoPE: original maximum position embeddings.", _YARN)
    make_vocab_size_divisible_by: int = setting(128, "Pad the vocabulary to a multiple of this (times TP).",
                                                read(HF_CHECK))
    padded_vocab_size: int | None = setting(None, "Vocabulary size after padding; unset means from the tokenizer.",
                                            read(HF_CHECK))
    add_qkv_bias: bool = setting(False, "Bias on the Q, K and V projections only (Qwen2).", read(HF_CHECK))
    disable_bias_linear: bool = setting(False, "No bias on linear layers (other than add_qkv_bias).", read(HF_CHECK))
    attention_bias: bool = setting(False, "Bias on attention projections.", FROM_HF)
    untie_embeddings_and_output_weights: bool = setting(
        False, "Separate output layer instead of reusing the input embedding (false = tied).", read(HF_CHECK))
    normalization: str = setting("LayerNorm", "Normalization layer: LayerNorm or RMSNorm.", read(HF_CHECK))
    norm_epsilon: float = setting(1e-5, "Epsilon of the normalization layers.", read(HF_CHECK))
    swiglu: bool = setting(False, "SwiGLU MLP (gate and up projections).", read(HF_CHECK))
    qk_layernorm: bool = setting(False, "Normalize queries and keys per head (Qwen3).", read(HF_CHECK))
    attention_dropout: float = setting(0.1, "Dropout on attention probabilities.", _NO_DROPOUT)
    hidden_dropout: float = setting(0.1, "Dropout on hidden states.", _NO_DROPOUT)
    init_method_std: float = setting(0.02, "Standard deviation of the weight initialization.", read(
        TRAINER_OPTIONS, note="the PPO critic's new value head only; every other weight loads from a checkpoint or a "
                              "Hugging Face folder, which overwrites the initialisation"))
    multi_latent_attention: bool = setting(False, "Multi-head latent attention (DeepSeek MLA).", _DEEPSEEK)
    qk_pos_emb_head_dim: int | None = setting(None, "MLA: rotary part of the query/key head dimension.", _DEEPSEEK)
    qk_head_dim: int | None = setting(None, "MLA: non-rotary query/key head dimension.", _DEEPSEEK)
    q_lora_rank: int | None = setting(None, "MLA: low rank of the query projection; unset: one query projection.",
                                      _DEEPSEEK)
    kv_lora_rank: int | None = setting(None, "MLA: low rank of the key/value projection.", _DEEPSEEK)
    v_head_dim: int | None = setting(None, "MLA: value head dimension.", _DEEPSEEK)
    num_experts: int | None = setting(None, "MoE: number of routed experts; unset means a dense model.", _HF_MOE)
    n_shared_experts: int | None = setting(None, "MoE: number of shared experts (each of moe_ffn_hidden_size).",
                                           _DEEPSEEK)
    moe_ffn_hidden_size: int | None = setting(None, "MoE: expert MLP inner dimension; unset means ffn_hidden_size.",
                                              read(HF_CHECK))
    moe_router_topk: int = setting(2, "MoE: experts per token.", _HF_MOE)
    moe_router_load_balancing_type: str = setting("aux_loss", "MoE: load balancing (aux_loss, seq_aux_loss, none).",
                                                  read(TRAINER_OPTIONS, MOE_RULES))
    moe_router_num_groups: int | None = setting(None, "MoE: expert groups for group-limited routing.", _DEEPSEEK)
    moe_router_group_topk: int | None = setting(None, "MoE: groups chosen per token; unset: no group-limited routing.",
                                                _DEEPSEEK)
    moe_router_topk_scaling_factor: float | None = setting(None, "MoE: scaling of routed expert weights.", _DEEPSEEK)
    norm_topk_prob: bool = setting(False, "MoE: renormalize the top-k routing weights.", read(HF_CHECK))
    moe_router_score_function: str = setting("softmax", "MoE: routing score, softmax or sigmoid.", _DEEPSEEK)
    moe_router_enable_expert_bias: bool = setting(
        False, "MoE: dynamic expert bias (aux-loss-free balancing: the bias moves towards balance every step).", read(
            MOE_RULES, TRAINER_OPTIONS, note="compared with the config.json (a DeepSeek-V3 router has its bias); the bias update in "
                            "training is services/trainer/expert_bias.py's"))
    moe_aux_loss_coeff: float = setting(0.001, "MoE: auxiliary (load-balancing) loss coefficient.",
                                        read(TRAINER_OPTIONS, MOE_RULES))
    first_k_dense_replace: int | None = setting(None, "MoE: the first k layers are dense (before moe_layer_freq).",
                                                _DEEPSEEK)
    moe_layer_freq: _Layers = setting(None, "MoE: which layers are MoE layers (Megatron's: N = every N-th from layer 0, "
                                            "or a 0/1 list); unset: every layer.", read(HF_CHECK))
    seq_aux: bool = setting(False, "MoE: compute the auxiliary loss per sequence (MindSpeed-LLM's DeepSeek router).",
                            refused("MindSpeed-LLM's own per-sequence aux loss of its DeepSeek router is not "
                                    "implemented; Megatron's is: set moe_router_load_balancing_type: seq_aux_loss",
                                    allowed=(False,)))
