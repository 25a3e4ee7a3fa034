"""`MegatronConfig`: the keys of `megatron_training`, `actor_config` and `ref_config`.

Every key MindSpeed-RL accepts there (Megatron-LM / MindSpeed argument names, dashes read as
underscores), on top of the architecture keys of `ModelConfig` (architecture.py), so each default is
written once. Defaults follow MindSpeed-RL's `MegatronConfig` (e.g. `bf16` true, `seed` 1234, `lr`
unset), except where it points into its own source tree (`prompt_type_path`). Each key's status
(read / refused / inert) sits beside it; docs/config.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config.architecture import ModelConfig
from services.common.config.schema import inert, read, refused, setting
from services.common.config.statuses import (
    ACTIVATIONS,
    ALGORITHM,
    ASCEND,
    COORDINATOR_APP,
    COORDINATOR_RUN,
    DERIVED,
    DPO,
    HF_CHECK,
    KERNEL,
    LOADER,
    LORA_RULES,
    MEMORY,
    MOE_RULES,
    MULTIMODAL,
    RESUME,
    TRAINER_LAUNCH,
    TRAINER_OPTIONS,
    UPSTREAM_UNUSED,
    VALIDATION,
)

_Layers = int | str | list[int] | None  # Megatron accepts "4,4,4", a list, or a pattern string.
_LOADER_ONLY = inert("worker processes of the data loader: no effect on which prompts a batch holds")
_TEMPLATE = inert("the chat template is applied when the dataset is preprocessed (`rlfabric preprocess`, with the "
                  "dataset YAML's prompt_type / prompt_type_path); training reads token ids")
_RECOMPUTE = "Megatron's, in the trainer's TransformerConfig; combinations checked as Megatron does"
_PLAN = "services/planning/plan.py"
_SAVES_ALL = inert("rlfabric always saves the optimizer and RNG state, so any checkpoint can resume a run")


_LORA_READ = read(TRAINER_OPTIONS, LORA_RULES, note="the actor's adapters (services/trainer/lora.py); the "
                  "reference is the base model")


def _dpo() -> object:
    return refused("rlfabric trains GRPO and DAPO", feature=DPO)


@dataclass(kw_only=True)
class MegatronConfig(ModelConfig):
    """Megatron training arguments (`megatron_training`, merged with `actor_config` / `ref_config`)."""

    model: str | None = setting(None, "Name of the model block (from `defaults: model:`) merged in first.",
                                read(LOADER))

    # Implementation switches (kernels, fusions): the same math on every platform.
    use_mcore_models: bool = setting(False, "Build megatron-core models (rlfabric always does).",
                                     inert("rlfabric always builds megatron-core models"))
    spec: str | list[str] | None = setting(None, "Custom layer spec: <module> <function>.", inert(
        "rlfabric picks the layer spec for the model type it loads (services/trainer/model.py)"))
    transformer_impl: str = setting("local", "Transformer implementation: local or transformer_engine.", KERNEL)
    sequence_parallel: bool = setting(False, "Sequence parallelism inside tensor-parallel groups.", read(
        TRAINER_OPTIONS, ACTIVATIONS, note="Megatron's, in the trainer's TransformerConfig; off at TP 1, as Megatron "
                                           "turns it off"))
    use_flash_attn: bool = setting(False, "Use a flash attention kernel.", KERNEL)
    use_fused_rmsnorm: bool = setting(False, "Use a fused RMSNorm kernel.", KERNEL)
    use_fused_swiglu: bool = setting(False, "Use a fused SwiGLU kernel.", KERNEL)
    use_fused_rotary_pos_emb: bool = setting(False, "Use a fused rotary embedding kernel.", KERNEL)
    shape_order: str = setting("SBH", "Input layout of flash attention.", KERNEL)
    no_bias_dropout_fusion: bool = setting(False, "Disable bias + dropout fusion.", KERNEL)
    no_masked_softmax_fusion: bool = setting(False, "Disable masked softmax fusion.", KERNEL)
    attention_softmax_in_fp32: bool = setting(False, "Compute the attention softmax in fp32.", KERNEL)
    no_gradient_accumulation_fusion: bool = setting(False, "Disable fused gradient accumulation into main_grad.",
                                                    KERNEL)
    gemm_gradient_accumulation_fusion: bool = setting(False, "Fuse GEMM and gradient accumulation (Ascend).", KERNEL)
    moe_grouped_gemm: bool = setting(False, "MoE: grouped GEMM for experts.", KERNEL)
    moe_permutation_async_comm: bool = setting(False, "MoE: overlap permutation all-gathers.", MEMORY)
    moe_tp_extend_ep: bool = setting(False, "MoE: experts are not split over TP ranks; the TP group extends expert "
                                            "parallelism (EP x TP ranks share the experts).", read(
        DERIVED, MOE_RULES, note="MindSpeed's expert layout (the same math): derived sizes give megatron-core's "
                                 "expert parallel size EP x TP and expert tensor parallel size 1; validated as "
                                 "MindSpeed does (num_experts divisible by TP x EP, moe_grouped_gemm and "
                                 "moe_permutation_async_comm set)"))
    moe_alltoall_overlap_comm: bool = setting(False, "MoE: overlap all-to-all communication.", MEMORY)
    use_fused_moe_token_permute_and_unpermute: bool = setting(False, "MoE: fused token permutation.", KERNEL)
    moe_token_dispatcher_type: str | None = setting(None, "MoE: token dispatcher (allgather, alltoall, alltoall_seq); "
                                                          "unset: Megatron's allgather.", read(
        TRAINER_OPTIONS, MOE_RULES, note="how tokens reach their experts (the same math); MindSpeed's alltoall_seq "
                                         "runs as megatron-core's alltoall, which replaced it"))
    # Precision.
    bf16: bool = setting(True, "Train in bfloat16 with fp32 main grads, master weights and Adam state (Megatron's mixed "
                               "precision, services/trainer/optimizer.py); false trains in fp32.",
                         read(DERIVED))
    fp16: bool = setting(False, "Train in float16 with dynamic loss scaling.", refused(
        "fp16 training (Megatron's dynamic loss scaling) is not implemented by rlfabric's trainer; use bf16: true "
        "(fp32 masters, no loss scale needed) or bf16: false (fp32)"))
    initial_loss_scale: float = setting(2.0 ** 32, "Initial loss scale (fp16 only).", inert(
        "Megatron reads it only with fp16, which rlfabric refuses (`fp16`); bf16 and fp32 train without a loss "
        "scale, as in Megatron"))
    accumulate_allreduce_grads_in_fp32: bool = setting(False, "Accumulate and all-reduce gradients in fp32.", inert(
        "rlfabric always accumulates and all-reduces gradients in fp32 main-grad buffers, which Megatron forces "
        "for bf16 whatever this key says (fp32 weights have fp32 grads); it would matter only for fp16, refused"))
    reuse_fp32_param: bool = setting(False, "Keep fp32 master weights as the bf16 parameters plus 16-bit residuals.",
                                     read(TRAINER_OPTIONS, note=(
        "MindSpeed's memory trick (2 bytes less per master weight, the same fp32 values), done by rlfabric's "
        "optimizer on every platform; bf16 only; as in MindSpeed, parameters round ties away from zero")))

    # Parallelism.
    tensor_model_parallel_size: int = setting(1, "Tensor parallel size (TP) of the trainer.",
                                              read(TRAINER_LAUNCH, DERIVED))
    pipeline_model_parallel_size: int = setting(1, "Pipeline parallel size (PP) of the trainer.",
                                                read(TRAINER_LAUNCH, DERIVED))
    context_parallel_size: int = setting(1, "Context parallel size (CP) of the trainer.", read(
        DERIVED, note="sizes the device layout as upstream; rlfabric's trainer does not split sequences, which "
                      "gives the same numbers"))
    context_parallel_algo: str = setting("ulysses_cp_algo", "CP algorithm: ulysses_cp_algo or megatron_cp_algo.",
                                         inert("how a sequence is split over CP ranks: the same math; rlfabric "
                                               "does not split sequences"))
    # The trainer's ranks take it as derived.actor_expert_parallel_size (services/trainer/launch.py).
    expert_model_parallel_size: int = setting(1, "Expert parallel size (EP) of the trainer (MoE models).",
                                              read(DERIVED, MOE_RULES))
    num_layers_per_virtual_pipeline_stage: int | None = setting(None, "Layers per virtual pipeline stage.", refused(
        "interleaved (virtual) pipeline stages are not implemented by rlfabric's trainer"))
    num_layer_list: _Layers = setting(None, "Layers per pipeline stage, e.g. \"7,7,8,8\" (one entry per stage, "
                                            "summing to num_layers, no-op layers counted).", read(
        TRAINER_OPTIONS, VALIDATION, ACTIVATIONS, _PLAN,
        note="the trainer's stages hold these layers (megatron-core's pipeline layout); conversion, checkpoints and "
             "weight sync follow them"))
    noop_layers: _Layers = setting(None, "Global indices of identity layers, counted in num_layers, e.g. \"5,95\": "
                                         "the model has num_layers minus these, placed as if they were layers.", read(
        TRAINER_OPTIONS, VALIDATION, ACTIVATIONS, _PLAN, HF_CHECK,
        note="MindSpeed's identity layers: they only move the other layers' pipeline stages; the trainer builds "
             "each stage's real layers (one fewer for each no-op layer on it)"))
    use_tp_pp_dp_mapping: bool = setting(False, "Order ranks TP-PP-DP instead of TP-DP-PP.",
                                         inert("rank order only: the same math"))
    distributed_backend: str = setting("nccl", "torch.distributed backend: nccl, hccl or gloo (CPU).", inert(
        "rlfabric picks the backend of the platform it runs on (gloo on CPU); validated as upstream"))
    use_distributed_optimizer: bool = setting(False, "Shard fp32 master weights and Adam state over data-parallel "
                                                     "ranks (reduce-scatter grads, all-gather params).",
                                              read(TRAINER_OPTIONS))
    overlap_grad_reduce: bool = setting(False, "Overlap the DDP gradient reduce with backward.", inert(
        "timing only (the same sums): rlfabric's optimizer reduces the gradients after the backward pass, in "
        "buckets like Megatron's, without overlapping them with it"))
    overlap_param_gather: bool = setting(False, "Overlap the parameter all-gather with forward.", inert(
        "timing only (the same weights): the distributed optimizer all-gathers the updated parameters right "
        "after its step, not overlapped with the next forward pass"))
    ddp_bucket_size: int | None = setting(None, "DDP bucket size in parameters.", MEMORY)
    no_shared_storage: bool = setting(False, "Nodes do not share a file system (each writes its own files).", inert(
        "rlfabric's trainer writes checkpoints from its own rank 0 of each model-parallel position"))

    # Batches and data.
    global_batch_size: int | None = setting(None, "Prompts per iteration (each gets n_samples_per_prompt samples).",
                                            read(COORDINATOR_APP, COORDINATOR_RUN, DERIVED))
    micro_batch_size: int | None = setting(None, "Rows (samples) per forward/backward pass.",
                                           read(TRAINER_OPTIONS, DERIVED))
    seq_length: int | None = setting(None, "Sequence length the trainer is configured for.", read(
        VALIDATION, note="bounds generate_config.max_model_len, as upstream; the trainer takes sequences at "
                         "their own length"))
    variable_seq_lengths: bool = setting(False, "Allow variable sequence lengths between micro-batches.", inert(
        "rlfabric's micro-batches have the lengths of their own sequences; under pipeline parallel it pads a "
        "pass's micro-batches (packed or not) to one shape, the same math, so upstream's need for it with "
        "use_remove_padding does not arise"))
    no_pad_to_seq_lengths: bool = setting(False, "Do not pad batches to seq_length.", inert(
        "padding only: rlfabric never pads to seq_length, and padding is masked out of the loss"))
    pad_to_multiple_of: int = setting(8, "Pad sequence lengths to a multiple of this.", inert(
        "padding only: masked out of the loss"))
    data_path: str | None = setting(None, "Prefix of the preprocessed dataset (…/data -> …/data_packed_*).",
                                    read(COORDINATOR_APP))
    split: str | None = setting(None, "Train/valid/test split, e.g. \"100,0,0\".", refused(
        "rlfabric trains on the whole dataset and evaluates nothing during training",
        allowed=(None, "100,0,0", "100", "100,0")))
    dataloader_type: str | None = setting(None, "Data loader type: single or cyclic.", UPSTREAM_UNUSED)
    num_workers: int = setting(2, "Data loader worker processes.", _LOADER_ONLY)
    no_shuffle: bool = setting(False, "Do not shuffle the prompts: every epoch in dataset order.",
                               read(COORDINATOR_APP))
    full_shuffle_instruction_dataset: bool = setting(False, "Shuffle the whole instruction dataset.",
                                                     UPSTREAM_UNUSED)
    is_instruction_dataset: bool = setting(False, "The dataset is an instruction dataset.", UPSTREAM_UNUSED)
    is_pairwise_dataset: bool = setting(False, "The dataset is pairwise (chosen/rejected).", _dpo())
    dataset_additional_keys: list[str] = setting(
        help="Extra dataset fields loaded with prompts (e.g. labels).", factory=list, status=refused(
            "rlfabric's prompt loader reads prompts and `labels` (loaded whenever the dataset has them); other "
            "fields are not passed to verifiers", allowed=([], ["labels"])))
    reset_position_ids: bool = setting(False, "Reset position ids at document boundaries.", inert(
        "packing only: rlfabric's packed rows (rl_config.use_remove_padding) always restart positions at each "
        "sequence, which upstream asks this key for"))
    reset_attention_mask: bool = setting(False, "Reset the attention mask at document boundaries.", inert(
        "packing only: in rlfabric's packed rows (rl_config.use_remove_padding) each sequence always attends "
        "only to itself"))
    attention_mask_type: str = setting("causal", "Attention mask type (causal).",
                                       refused("rlfabric trains causal language models", allowed=("causal",)))
    prompt_type: str | None = setting(None, "Chat template name from templates.json.", _TEMPLATE)
    prompt_type_path: str | None = setting(
        None, "templates.json path; unset means model/templates.json next to the config.", _TEMPLATE)
    tokenizer_type: str | None = setting(None, "Tokenizer kind, e.g. PretrainedFromHF.", refused(
        "rlfabric loads Hugging Face tokenizers", allowed=(None, "PretrainedFromHF")))
    tokenizer_name_or_path: str | None = setting(None, "Hugging Face tokenizer folder.",
                                                 read(COORDINATOR_APP, TRAINER_OPTIONS, DERIVED))
    tokenizer_not_use_fast: bool = setting(False, "Use the slow tokenizer.", inert(
        "rlfabric tokenizes only when preprocessing and decodes responses for verifiers; fast and slow "
        "tokenizers give the same ids"))
    tokenizer_padding_side: str = setting("right", "Tokenizer padding side.",
                                          inert("rlfabric moves token ids unpadded"))
    vocab_extra_ids: int = setting(0, "Extra sentinel tokens added to the vocabulary.",
                                   refused("the vocabulary is the loaded model's"))

    # Optimizer and schedule.
    optimizer: str = setting("adam", "Optimizer: adam or sgd.",
                             refused("rlfabric's trainer optimizes with Adam (decoupled weight decay)"))
    lr: float | None = setting(None, "Learning rate.", read(TRAINER_OPTIONS))
    lr_decay_style: str = setting("linear", "Schedule: constant, linear, cosine, inverse-square-root or WSD.",
                                  read(TRAINER_OPTIONS))
    min_lr: float = setting(0.0, "Learning rate floor of the schedule.", read(TRAINER_OPTIONS))
    lr_warmup_fraction: float | None = setting(None, "Fraction of train_iters spent warming up.",
                                               read(TRAINER_OPTIONS))
    weight_decay: float = setting(0.01, "Decoupled weight decay.", read(TRAINER_OPTIONS))
    clip_grad: float = setting(1.0, "Gradient clipping by global norm (0 disables).", read(TRAINER_OPTIONS))
    adam_beta1: float = setting(0.9, "Adam beta1.", read(TRAINER_OPTIONS))
    adam_beta2: float = setting(0.999, "Adam beta2.", read(TRAINER_OPTIONS))

    # Training loop.
    train_iters: int | None = setting(None, "Number of GRPO iterations.", read(TRAINER_OPTIONS, COORDINATOR_RUN))
    stage: str | None = setting(None, "Training algorithm: ray_grpo or ray_dapo (unset: ray_grpo).", read(ALGORITHM))
    seed: int = setting(1234, "Random seed (data order, initialization, dropout).",
                        read(COORDINATOR_APP, TRAINER_OPTIONS))
    log_interval: int = setting(100, "Megatron log interval (iterations).",
                                inert("rlfabric logs every iteration (console, metrics.jsonl, TensorBoard)"))
    eval_interval: int = setting(1000, "Evaluation interval (iterations).", UPSTREAM_UNUSED)
    eval_iters: int = setting(100, "Evaluation iterations.", UPSTREAM_UNUSED)
    skip_train: bool = setting(False, "Skip training (evaluation only).", refused("rlfabric always trains"))
    log_throughput: bool = setting(False, "Log Megatron's throughput per device.",
                                   inert("rlfabric logs e2e_tps, update_tps and vllm_tps every iteration"))
    do_sample: bool = setting(False, "Sample in Megatron generation (unused by rlfabric).",
                              inert("Megatron text generation; rollout uses vLLM"))
    use_kv_cache: bool = setting(False, "KV cache in Megatron generation (unused by rlfabric).",
                                 inert("Megatron text generation; rollout uses vLLM"))
    algorithm: str | None = setting(None, "Algorithm tag (unused by rlfabric).", UPSTREAM_UNUSED)
    dpo_loss_type: str = setting("sigmoid", "DPO loss type (unused by rlfabric).", _dpo())
    ref_model: str = setting("", "DPO reference model path (unused by rlfabric).", _dpo())
    refer_model_iter: int = setting(1, "DPO reference model iteration (unused by rlfabric).", _dpo())

    # Checkpoints.
    finetune: bool = setting(False, "Load weights only and start at iteration 0 (true) or resume (false).",
                             read(TRAINER_OPTIONS, RESUME))
    load: str | None = setting(None, "Checkpoint directory to load.", read(TRAINER_OPTIONS, DERIVED, RESUME))
    save: str | None = setting(None, "Checkpoint directory to save to.", read(COORDINATOR_RUN))
    save_interval: int | None = setting(None, "Save a checkpoint every this many iterations (and at the end).",
                                        read(COORDINATOR_RUN))
    no_load_optim: bool | None = setting(None, "Do not load the optimizer state.", read(TRAINER_OPTIONS))
    no_load_rng: bool | None = setting(None, "Do not load the RNG state.", read(TRAINER_OPTIONS))
    no_save_optim: bool | None = setting(None, "Do not save the optimizer state.", _SAVES_ALL)
    no_save_rng: bool | None = setting(None, "Do not save the RNG state.", _SAVES_ALL)
    load_checkpoint_loosely: bool = setting(False, "Load checkpoints non-strictly.",
                                            refused("rlfabric loads checkpoints strictly (every tensor must match)"))
    pretrained_checkpoint: str | None = setting(None, "Pretrained checkpoint for finetuning.",
                                                refused("name the weights to start from in `load`"))
    enable_high_availability: bool = setting(False, "MindIO high availability (Ascend).", ASCEND)

    # Memory and Ascend-specific features.
    recompute_granularity: str | None = setting(None, "Activation recomputation: full or selective.",
                                                read(TRAINER_OPTIONS, ACTIVATIONS, note=_RECOMPUTE))
    recompute_method: str | None = setting(None, "Recomputation method: uniform or block.",
                                           read(TRAINER_OPTIONS, ACTIVATIONS, note=_RECOMPUTE))
    recompute_num_layers: int | None = setting(None, "Layers per recomputation unit (uniform) or per stage (block).",
                                               read(TRAINER_OPTIONS, ACTIVATIONS, note=_RECOMPUTE))
    recompute_activation_function: bool = setting(False, "Recompute the MLP activation.", read(
        TRAINER_OPTIONS, note="MindSpeed's feature on megatron-core's MLP (services/trainer/activation_memory.py), "
                              "every layer"))
    swap_attention: bool = setting(False, "Swap attention activations to host (Ascend).", read(
        TRAINER_OPTIONS, platform="ascend", note="passed to MindSpeed (--swap-attention) when the trainer imports it "
                                                 "on Ascend; no other platform has the feature: the trainer logs that "
                                                 "it is not applied"))
    swap_optimizer: bool = setting(False, "Swap optimizer state to host (Ascend).", MEMORY)
    use_ascend_coc: bool = setting(False, "Ascend compute-communication overlap.", ASCEND)
    coc_mode: int = setting(-1, "CoC mode (Ascend).", ASCEND)
    coc_parallel_num: int = setting(1, "CoC parallelism (Ascend).", ASCEND)
    coc_fused_kernel: bool = setting(False, "CoC fused kernel (Ascend).", ASCEND)
    npu_deterministic: bool = setting(False, "Deterministic NPU kernels (Ascend).", ASCEND)
    no_check_for_nan_in_loss_and_grad: bool = setting(False, "Skip NaN checks of loss and gradients.", inert(
        "rlfabric always checks the gradient norm and skips an optimizer step whose norm is not finite"))
    use_cp_send_recv_overlap: bool = setting(False, "Overlap send/recv in ring CP.", MEMORY)
    use_fused_ring_attention_update: bool = setting(False, "Fused ring attention update in CP.", KERNEL)
    ai_framework: str | None = setting(None, "Backend framework: unset (PyTorch) or mindspore.",
                                       refused("rlfabric's trainer runs PyTorch and megatron-core"))
    mm_model: str | None = setting(None, "Multimodal model description file (unsupported by rlfabric).",
                                   refused("rlfabric trains text-only models", feature=MULTIMODAL))

    # LoRA.
    lora_r: int = setting(8, "LoRA rank.", _LORA_READ)
    lora_alpha: int = setting(16, "LoRA alpha (the adapter's output is scaled by alpha / r).", _LORA_READ)
    lora_fusion: bool = setting(False, "MindSpeed-LLM's CCLoRA: overlap the adapters' compute with communication.",
                                inert("MindSpeed-LLM's CCLoRA, an Ascend compute/communication overlap of the "
                                      "adapter path with the same numerics; rlfabric's adapters run unfused"))
    lora_target_modules: list[str] | None = setting(None, "Modules LoRA adapts; unset disables LoRA.", _LORA_READ)
    lora_ckpt_filter: bool = setting(False, "Save only LoRA parameters (the base comes from load / the HF weights).",
                                     read(TRAINER_OPTIONS, LORA_RULES))
