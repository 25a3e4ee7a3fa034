"""The Megatron sections: `ModelConfig` (a `configs/model/*.yaml` block) and `MegatronConfig`.

`MegatronConfig` holds every key MindSpeed-RL accepts in `megatron_training`, `actor_config` and
`ref_config` (Megatron-LM / MindSpeed argument names, dashes read as underscores). It extends
`ModelConfig`, the architecture keys a model block carries, so each default is written once.
Defaults follow MindSpeed-RL's `MegatronConfig` (e.g. `bf16` true, `seed` 1234, `lr` unset), except
where it points into its own source tree (`prompt_type_path` resolves next to the config file).
Keys that only matter on Ascend (CoC, swap, msprobe-style switches) are accepted so upstream YAMLs
load; rlfabric ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config.schema import setting

_Layers = int | str | list[int] | None  # Megatron accepts "4,4,4", a list, or a pattern string.


@dataclass(kw_only=True)
class ModelConfig:
    """Model architecture: the keys of one block in `configs/model/<name>.yaml`."""

    num_layers: int | None = setting(None, "Number of transformer layers.")
    hidden_size: int | None = setting(None, "Hidden (model) dimension.")
    ffn_hidden_size: int | None = setting(None, "MLP inner dimension (per gate for SwiGLU).")
    num_attention_heads: int | None = setting(None, "Number of query heads.")
    kv_channels: int | None = setting(None, "Head dimension; unset means hidden_size / num_attention_heads.")
    group_query_attention: bool = setting(False, "Use grouped-query attention (num_query_groups KV heads).")
    num_query_groups: int = setting(1, "Number of key/value heads when group_query_attention is true.")
    max_position_embeddings: int | None = setting(None, "Longest position the model was built for.")
    position_embedding_type: str = setting("learned_absolute", "Position embedding: rope, learned_absolute or none.")
    use_rotary_position_embeddings: bool = setting(False, "Legacy switch for rotary embeddings.")
    rotary_base: int | float = setting(10000, "RoPE base (theta).")
    rope_scaling_type: str | None = setting(None, "RoPE scaling variant (llama3, yarn, ...); unset means none.")
    rope_scaling_factor: float = setting(1.0, "RoPE scaling factor.")
    low_freq_factor: float | None = setting(None, "Llama3 RoPE scaling: low-frequency factor.")
    high_freq_factor: float | None = setting(None, "Llama3 RoPE scaling: high-frequency factor.")
    original_max_position_embeddings: int | None = setting(None, "Context length before RoPE scaling.")
    beta_fast: int | float = setting(32, "YaRN RoPE: beta fast.")
    beta_slow: int | float = setting(1, "YaRN RoPE: beta slow.")
    rope_scaling_mscale: float = setting(1.0, "YaRN RoPE: mscale.")
    rope_scaling_mscale_all_dim: float = setting(0.0, "YaRN RoPE: mscale for all dimensions.")
    rope_scaling_original_max_position_embeddings: int | None = setting(
        None, "YaRN RoPE: original maximum position embeddings.")
    make_vocab_size_divisible_by: int = setting(128, "Pad the vocabulary to a multiple of this (times TP).")
    padded_vocab_size: int | None = setting(None, "Vocabulary size after padding; unset means from the tokenizer.")
    add_qkv_bias: bool = setting(False, "Bias on the Q, K and V projections only (Qwen2).")
    disable_bias_linear: bool = setting(False, "No bias on linear layers (other than add_qkv_bias).")
    attention_bias: bool = setting(False, "Bias on attention projections.")
    untie_embeddings_and_output_weights: bool = setting(
        False, "Separate output layer instead of reusing the input embedding (false = tied).")
    normalization: str = setting("LayerNorm", "Normalization layer: LayerNorm or RMSNorm.")
    norm_epsilon: float = setting(1e-5, "Epsilon of the normalization layers.")
    swiglu: bool = setting(False, "SwiGLU MLP (gate and up projections).")
    qk_layernorm: bool = setting(False, "Normalize queries and keys per head (Qwen3).")
    attention_dropout: float = setting(0.1, "Dropout on attention probabilities.")
    hidden_dropout: float = setting(0.1, "Dropout on hidden states.")
    init_method_std: float = setting(0.02, "Standard deviation of the weight initialization.")
    multi_latent_attention: bool = setting(False, "Multi-head latent attention (DeepSeek MLA).")
    qk_pos_emb_head_dim: int | None = setting(None, "MLA: rotary part of the query/key head dimension.")
    qk_head_dim: int | None = setting(None, "MLA: non-rotary query/key head dimension.")
    q_lora_rank: int | None = setting(None, "MLA: low rank of the query projection.")
    kv_lora_rank: int | None = setting(None, "MLA: low rank of the key/value projection.")
    v_head_dim: int | None = setting(None, "MLA: value head dimension.")
    num_experts: int | None = setting(None, "MoE: number of routed experts; unset means a dense model.")
    n_shared_experts: int | None = setting(None, "MoE: number of shared experts.")
    moe_ffn_hidden_size: int | None = setting(None, "MoE: expert MLP inner dimension.")
    moe_router_topk: int = setting(2, "MoE: experts per token.")
    moe_router_load_balancing_type: str = setting("aux_loss", "MoE: load balancing (aux_loss, seq_aux_loss, none, ...).")
    moe_router_num_groups: int | None = setting(None, "MoE: expert groups for group-limited routing.")
    moe_router_group_topk: int | None = setting(None, "MoE: groups chosen per token.")
    moe_router_topk_scaling_factor: float | None = setting(None, "MoE: scaling of routed expert weights.")
    norm_topk_prob: bool = setting(False, "MoE: renormalize the top-k routing weights.")
    moe_router_score_function: str = setting("softmax", "MoE: routing score, softmax or sigmoid.")
    moe_router_enable_expert_bias: bool = setting(False, "MoE: dynamic expert bias (aux-loss-free balancing).")
    moe_aux_loss_coeff: float = setting(0.001, "MoE: auxiliary loss coefficient.")
    first_k_dense_replace: int | None = setting(None, "MoE: the first k layers are dense.")
    moe_layer_freq: _Layers = setting(None, "MoE: which layers are MoE layers.")
    seq_aux: bool = setting(False, "MoE: compute the auxiliary loss per sequence.")


@dataclass(kw_only=True)
class MegatronConfig(ModelConfig):
    """Megatron training arguments (`megatron_training`, merged with `actor_config` / `ref_config`)."""

    model: str | None = setting(None, "Name of the model block (from `defaults: model:`) merged in first.")

    # Implementation switches (kernels, fusions); rlfabric picks CPU-safe kernels where needed.
    use_mcore_models: bool = setting(False, "Build megatron-core models (rlfabric always does).")
    spec: str | list[str] | None = setting(None, "Custom layer spec: <module> <function>.")
    transformer_impl: str = setting("local", "Transformer implementation: local or transformer_engine.")
    sequence_parallel: bool = setting(False, "Sequence parallelism inside tensor-parallel groups.")
    use_flash_attn: bool = setting(False, "Use a flash attention kernel.")
    use_fused_rmsnorm: bool = setting(False, "Use a fused RMSNorm kernel.")
    use_fused_swiglu: bool = setting(False, "Use a fused SwiGLU kernel.")
    use_fused_rotary_pos_emb: bool = setting(False, "Use a fused rotary embedding kernel.")
    shape_order: str = setting("SBH", "Input layout of flash attention.")
    no_bias_dropout_fusion: bool = setting(False, "Disable bias + dropout fusion.")
    no_masked_softmax_fusion: bool = setting(False, "Disable masked softmax fusion.")
    attention_softmax_in_fp32: bool = setting(False, "Compute the attention softmax in fp32.")
    no_gradient_accumulation_fusion: bool = setting(False, "Disable fused gradient accumulation into main_grad.")
    gemm_gradient_accumulation_fusion: bool = setting(False, "Fuse GEMM and gradient accumulation (Ascend).")
    moe_grouped_gemm: bool = setting(False, "MoE: grouped GEMM for experts.")
    moe_permutation_async_comm: bool = setting(False, "MoE: overlap permutation all-gathers.")
    moe_tp_extend_ep: bool = setting(False, "MoE: use the TP group to extend expert parallelism.")
    moe_alltoall_overlap_comm: bool = setting(False, "MoE: overlap all-to-all communication.")
    use_fused_moe_token_permute_and_unpermute: bool = setting(False, "MoE: fused token permutation.")
    moe_token_dispatcher_type: str | None = setting(None, "MoE: token dispatcher (allgather, alltoall).")

    # Precision.
    bf16: bool = setting(True, "Train in bfloat16 (the accelerator default); false trains in fp32 (CPU).")
    initial_loss_scale: float = setting(2.0 ** 32, "Initial loss scale (fp16 only).")
    accumulate_allreduce_grads_in_fp32: bool = setting(False, "Accumulate and all-reduce gradients in fp32.")
    reuse_fp32_param: bool = setting(False, "Distributed optimizer frees fp32 parameter copies (Ascend).")

    # Parallelism.
    tensor_model_parallel_size: int = setting(1, "Tensor parallel size (TP) of the trainer.")
    pipeline_model_parallel_size: int = setting(1, "Pipeline parallel size (PP) of the trainer.")
    context_parallel_size: int = setting(1, "Context parallel size (CP) of the trainer.")
    context_parallel_algo: str = setting("ulysses_cp_algo", "CP algorithm: ulysses_cp_algo or megatron_cp_algo.")
    expert_model_parallel_size: int = setting(1, "Expert parallel size (EP) of the trainer.")
    num_layers_per_virtual_pipeline_stage: int | None = setting(None, "Layers per virtual pipeline stage.")
    num_layer_list: _Layers = setting(None, "Layers per pipeline stage, e.g. \"4,4,4,4\".")
    noop_layers: _Layers = setting(None, "Indices of no-op layers.")
    use_tp_pp_dp_mapping: bool = setting(False, "Order ranks TP-PP-DP instead of TP-DP-PP.")
    distributed_backend: str = setting("nccl", "torch.distributed backend: nccl, hccl or gloo (CPU).")
    use_distributed_optimizer: bool = setting(False, "Shard optimizer state over data-parallel ranks.")
    overlap_grad_reduce: bool = setting(False, "Overlap the DDP gradient reduce with backward.")
    overlap_param_gather: bool = setting(False, "Overlap the parameter all-gather with forward.")
    ddp_bucket_size: int | None = setting(None, "DDP bucket size in parameters.")
    no_shared_storage: bool = setting(False, "Nodes do not share a file system (each writes its own files).")

    # Batches and data.
    global_batch_size: int | None = setting(None, "Prompts per iteration (each gets n_samples_per_prompt samples).")
    micro_batch_size: int | None = setting(None, "Rows (samples) per forward/backward pass.")
    seq_length: int | None = setting(None, "Sequence length the trainer is configured for.")
    variable_seq_lengths: bool = setting(False, "Allow variable sequence lengths between micro-batches.")
    no_pad_to_seq_lengths: bool = setting(False, "Do not pad batches to seq_length.")
    pad_to_multiple_of: int = setting(8, "Pad sequence lengths to a multiple of this.")
    data_path: str | None = setting(None, "Prefix of the preprocessed dataset (…/data -> …/data_packed_*).")
    split: str | None = setting(None, "Train/valid/test split, e.g. \"100,0,0\".")
    dataloader_type: str | None = setting(None, "Data loader type: single or cyclic.")
    num_workers: int = setting(2, "Data loader worker processes.")
    no_shuffle: bool = setting(False, "Do not shuffle the prompts.")
    full_shuffle_instruction_dataset: bool = setting(False, "Shuffle the whole instruction dataset.")
    is_instruction_dataset: bool = setting(False, "The dataset is an instruction dataset.")
    is_pairwise_dataset: bool = setting(False, "The dataset is pairwise (chosen/rejected).")
    dataset_additional_keys: list[str] = setting(help="Extra dataset fields loaded with prompts (e.g. labels).",
                                                 factory=list)
    reset_position_ids: bool = setting(False, "Reset position ids at document boundaries.")
    reset_attention_mask: bool = setting(False, "Reset the attention mask at document boundaries.")
    attention_mask_type: str = setting("causal", "Attention mask type (causal).")
    prompt_type: str | None = setting(None, "Chat template name from templates.json.")
    prompt_type_path: str | None = setting(None, "templates.json path; unset means model/templates.json next to the config.")
    tokenizer_type: str | None = setting(None, "Tokenizer kind, e.g. PretrainedFromHF.")
    tokenizer_name_or_path: str | None = setting(None, "Hugging Face tokenizer folder.")
    tokenizer_not_use_fast: bool = setting(False, "Use the slow tokenizer.")
    tokenizer_padding_side: str = setting("right", "Tokenizer padding side.")
    vocab_extra_ids: int = setting(0, "Extra sentinel tokens added to the vocabulary.")

    # Optimizer and schedule.
    optimizer: str = setting("adam", "Optimizer: adam or sgd.")
    lr: float | None = setting(None, "Learning rate.")
    lr_decay_style: str = setting("linear", "Schedule: constant, linear, cosine, inverse-square-root or WSD.")
    min_lr: float = setting(0.0, "Learning rate floor of the schedule.")
    lr_warmup_fraction: float | None = setting(None, "Fraction of train_iters spent warming up.")
    weight_decay: float = setting(0.01, "Decoupled weight decay.")
    clip_grad: float = setting(1.0, "Gradient clipping by global norm (0 disables).")
    adam_beta1: float = setting(0.9, "Adam beta1.")
    adam_beta2: float = setting(0.999, "Adam beta2.")

    # Training loop.
    train_iters: int | None = setting(None, "Number of GRPO iterations.")
    stage: str | None = setting(None, "Training algorithm, e.g. ray_grpo or ray_dapo.")
    seed: int = setting(1234, "Random seed (data order, initialization, dropout).")
    log_interval: int = setting(100, "Megatron log interval (iterations).")
    eval_interval: int = setting(1000, "Evaluation interval (iterations).")
    eval_iters: int = setting(100, "Evaluation iterations.")
    skip_train: bool = setting(False, "Skip training (evaluation only).")
    log_throughput: bool = setting(False, "Log Megatron's throughput per device.")
    do_sample: bool = setting(False, "Sample in Megatron generation (unused by rlfabric).")
    use_kv_cache: bool = setting(False, "KV cache in Megatron generation (unused by rlfabric).")
    algorithm: str | None = setting(None, "Algorithm tag (unused by rlfabric).")
    dpo_loss_type: str = setting("sigmoid", "DPO loss type (unused by rlfabric).")
    ref_model: str = setting("", "DPO reference model path (unused by rlfabric).")
    refer_model_iter: int = setting(1, "DPO reference model iteration (unused by rlfabric).")

    # Checkpoints.
    finetune: bool = setting(False, "Load weights only and start at iteration 0 (true) or resume (false).")
    load: str | None = setting(None, "Checkpoint directory to load.")
    save: str | None = setting(None, "Checkpoint directory to save to.")
    save_interval: int | None = setting(None, "Save a checkpoint every this many iterations (and at the end).")
    no_load_optim: bool | None = setting(None, "Do not load the optimizer state.")
    no_load_rng: bool | None = setting(None, "Do not load the RNG state.")
    no_save_optim: bool | None = setting(None, "Do not save the optimizer state.")
    no_save_rng: bool | None = setting(None, "Do not save the RNG state.")
    load_checkpoint_loosely: bool = setting(False, "Load checkpoints non-strictly.")
    pretrained_checkpoint: str | None = setting(None, "Pretrained checkpoint for finetuning.")
    enable_high_availability: bool = setting(False, "MindIO high availability (Ascend).")

    # Memory and Ascend-specific features (accepted, ignored by rlfabric).
    recompute_granularity: str | None = setting(None, "Activation recomputation: full or selective.")
    recompute_method: str | None = setting(None, "Recomputation method: uniform or block.")
    recompute_num_layers: int | None = setting(None, "Layers per recomputation unit.")
    recompute_activation_function: bool = setting(False, "Recompute the MLP activation.")
    swap_attention: bool = setting(False, "Swap attention activations to host (Ascend).")
    swap_optimizer: bool = setting(False, "Swap optimizer state to host (Ascend).")
    use_ascend_coc: bool = setting(False, "Ascend compute-communication overlap.")
    coc_mode: int = setting(-1, "CoC mode (Ascend).")
    coc_parallel_num: int = setting(1, "CoC parallelism (Ascend).")
    coc_fused_kernel: bool = setting(False, "CoC fused kernel (Ascend).")
    npu_deterministic: bool = setting(False, "Deterministic NPU kernels (Ascend).")
    no_check_for_nan_in_loss_and_grad: bool = setting(False, "Skip NaN checks of loss and gradients.")
    use_cp_send_recv_overlap: bool = setting(False, "Overlap send/recv in ring CP.")
    use_fused_ring_attention_update: bool = setting(False, "Fused ring attention update in CP.")
    ai_framework: str | None = setting(None, "Backend framework: unset (PyTorch) or mindspore.")
    mm_model: str | None = setting(None, "Multimodal model description file (unsupported by rlfabric).")

    # LoRA (accepted, not supported by rlfabric's trainer yet).
    lora_r: int = setting(8, "LoRA rank.")
    lora_alpha: int = setting(16, "LoRA alpha.")
    lora_fusion: bool = setting(False, "Fuse LoRA weights into the base weights.")
    lora_target_modules: list[str] | None = setting(None, "Modules LoRA adapts; unset disables LoRA.")
    lora_ckpt_filter: bool = setting(False, "Save only LoRA parameters.")
