"""The one place where rlfabric works round Megatron-core's CUDA-only code paths on a CPU-only host.

Megatron-core 0.16.1 assumes an accelerator in a handful of spots that a dense GPT training step
touches. On a machine without CUDA or an Ascend NPU this module makes those spots run on the CPU;
with an accelerator present every entry point here is a no-op (or the upstream call, unchanged),
so the normal NCCL / HCCL path is never altered.

Entry points:
    accelerator_present()      -> bool: the gate every patch checks (services/common/accelerator.py).
    apply_cpu_patches()        -> bool: idempotent, process-wide; True when patches were applied
                                 (also keeps freed host memory for reuse: memory.keep_freed_memory).
    apply_moe_patches()        : a MoE model's patches (any platform: Megatron's router without TransformerEngine).
    seed_model_parallel_rng(s) : Megatron's model-parallel seeding, CPU-safe.
    cpu_device_mode()          : context in which tensors that Megatron allocates with
                                 ``device="cuda"`` are created on the CPU instead.
    TorchNorm                  : Megatron's torch LayerNorm / RMSNorm wrapper, made to run under
                                 sequence parallelism (the local layer spec's norm on a CPU).

Each patch below is preceded by a note naming the upstream code it works around.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from services.common import determinism, memory
from services.common.accelerator import accelerator_present

logger = logging.getLogger(__name__)

_PATCHED = False


def apply_cpu_patches() -> bool:
    """Apply the process-wide CPU patches once; no-op (returns False) when an accelerator is present."""
    global _PATCHED
    if accelerator_present():
        return False
    if _PATCHED:
        return True
    # Upstream: megatron/core/models/common/embeddings/rotary_pos_embedding.py
    # (RotaryEmbedding.__init__ / get_emb: `self.inv_freq.to(device=torch.cuda.current_device())`,
    # run on every forward), megatron/core/utils.py (GlobalMemoryBuffer.get_tensor), and
    # megatron/core/transformer/dot_product_attention.py / attention.py (buffers allocated on
    # `torch.cuda.current_device()`). A CPU-only torch raises "Torch not compiled with CUDA" there,
    # so the current device is reported as the CPU. Only done when no accelerator exists, where
    # the original function can only raise.
    torch.cuda.current_device = _cpu_current_device
    # Upstream: megatron/core/pipeline_parallel/p2p_communication.py (`_communicate` and the shape
    # exchange call `torch.cuda.synchronize()` after the batched send/recv of pipeline stages).
    # CPU collectives (gloo) complete before `wait()` returns, so there is nothing to synchronise.
    torch.cuda.synchronize = _no_synchronize
    # Upstream: megatron/core/tensor_parallel/random.py (`_get_all_rng_states` / `_set_all_rng_states`,
    # called by CheckpointFunction and CheckpointWithoutOutput, i.e. every activation recompute, read
    # and restore the CUDA generator through `_get_cuda_rng_state` / `_set_cuda_rng_state`). Without
    # CUDA the first asserts, and the second would queue a callback in torch.cuda's lazy-init list on
    # every recompute, never run, never freed. A CPU process has no CUDA generator to save; the CPU
    # generator, the one that counts here, is saved and restored by the same functions.
    with compile_on_first_call():
        from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    _patch_alltoall_dispatcher()
    # Not Megatron's code but the same CPU-only step: on a GPU the caching allocator reuses the
    # activations' memory between micro-batches; on the CPU glibc would unmap (and page-fault again) every
    # block over 32 MiB, which made the W1 update cost per token double from 64 to 128 response tokens.
    memory.keep_freed_memory()
    _PATCHED = True
    logger.info("megatron_compat: no accelerator, CPU patches applied")
    return True


def apply_moe_patches() -> None:
    """Patches a MoE model needs on any platform (idempotent); call before its first forward."""
    # Upstream: megatron/core/transformer/moe/moe_utils.py imports `te_general_gemm` only when TransformerEngine
    # is importable, yet RouterGatingLinearFunction.forward/backward test `te_general_gemm is not None` always:
    # without TE (a CPU, or an Ascend NPU with MindSpeed) every router call raises NameError. The name is
    # defined as None, which selects the function's own torch.mm path, as upstream intends.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_alltoall_dispatcher() -> None:
    # Upstream: megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher.__init__ makes a
    # `torch.cuda.Stream()` for its device-to-host copies (a CPU-only torch raises "requires CUDA support"), and
    # `_maybe_dtoh_and_synchronize` copies the all-to-all split sizes to host on that stream, turning them into
    # numpy arrays; `maybe_move_tensor_to_cpu` converts only CUDA tensors, so on a CPU they would stay tensors.
    # The stream is never used once the method is replaced: the CPU version converts the splits as upstream
    # does (same values, same types) without a stream. Used by `moe_token_dispatcher_type: alltoall`.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


class _NoStream:
    """Stands in for the all-to-all dispatcher's CUDA side stream on a CPU (never used: see above)."""


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


@contextlib.contextmanager
def compile_on_first_call() -> Iterator[None]:
    """While Megatron-core is first imported, `torch.compile(fn)` returns a wrapper that compiles `fn` when first
    called, not at once.

    Upstream: megatron/core/jit.py sets `jit_fuser = torch.compile` (torch >= 2.2), and its fusion modules
    (fused_bias_geglu, fused_bias_swiglu, ...) decorate functions with it at import time; `torch.compile` imports
    torch._dynamo and torch._inductor before it returns, ~1.4 s of CPU per trainer rank (2.3 s -> 0.9 s for the
    whole `import megatron.core` here), paid at every start-up, while a CPU step calls none of those functions.
    The wrapper keeps the compile, its options and its first-call timing unchanged; it only moves the imports to
    a first call that may never come. A process where Megatron is already imported is unchanged.
    """
    real = torch.compile

    def deferred(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...): the decorator
            return lambda fn: deferred(fn, **kwargs)
        compiled: list = []

        @functools.wraps(model)
        def call(*args, **kw):
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def patches_applied() -> bool:
    """Whether apply_cpu_patches() changed this process."""
    return _PATCHED


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_synchronize(device: object = None) -> None:
    return None


def _no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> None:
    return None


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's RNG tracker for this rank (call after parallel_state is initialised)."""
    from megatron.core import tensor_parallel

    # As Megatron's _set_random_seed: the host generators too (a checkpoint saves their state).
    determinism.seed_host_rngs(seed)
    if accelerator_present():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    # Upstream: megatron/core/tensor_parallel/random.py, model_parallel_cuda_manual_seed ->
    # CudaRNGStatesTracker.add -> torch.cuda.get_rng_state, which asserts CUDA. Attention always
    # enters `get_cuda_rng_tracker().fork()` (dot_product_attention.py), so a tracker must exist:
    # the inference tracker is a no-op one, which is exact because rlfabric trains with dropout 0
    # (see model.py).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` (or a cuda torch.device) in torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.to,) and args[1:2] and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Run Megatron code that allocates on "cuda" by name, on the CPU.

    Upstream: megatron/core/pipeline_parallel/schedules.py (`total_num_tokens = torch.zeros(...,
    device="cuda")` in every forward_backward_* function), megatron/core/optimizer/clip_grads.py
    (`get_grad_norm_fp32` allocates its reduction buffers with `device='cuda'`), and
    megatron/core/pipeline_parallel/p2p_communication.py (receive buffers), and
    megatron/core/models/common/language_module/language_module.py
    (`setup_embeddings_and_output_layer`: `weight.data.cuda()` before the tied-embedding all-reduce
    when PP > 1; `Tensor.cuda` is made the identity). Those are small bookkeeping tensors, so a
    TorchFunctionMode redirects them. It is entered around Megatron's schedule (forward included),
    the grad norm and model construction; its per-call Python hook did not show in a profile of a
    tiny-model update, where matmuls and backward dominate.
    With an accelerator present this is a plain nullcontext.
    """
    if accelerator_present():
        yield
        return
    with _CudaToCpuMode():
        yield


@contextlib.contextmanager
def outside_cpu_device_mode() -> Iterator[None]:
    """Suspends an enclosing cpu_device_mode() for code that allocates nothing on "cuda" by name.

    Megatron's schedule needs the mode for its bookkeeping tensors, but the model's forward and the loss
    run inside the schedule's `forward_step`, where the mode's Python hook on each of their ~300 torch
    calls per micro-batch cost ~2 ms on W2's tiny model. Their CUDA-only spots (current_device) are
    patched process-wide instead. A no-op when the innermost mode is not cpu_device_mode's.
    """
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if isinstance(_get_current_function_mode(), _CudaToCpuMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def cpu_safe(fn):
    """Decorator form of cpu_device_mode()."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cpu_device_mode():
            return fn(*args, **kwargs)

    return wrapper


class TorchNorm:
    """Megatron's WrappedTorchNorm (torch.nn.RMSNorm / LayerNorm), also under sequence parallelism.

    Upstream: megatron/core/transformer/torch_norm.py asserts `not config.sequence_parallel`, and the
    local layer spec always picks it for RMSNorm (models/backends.py, LocalSpecProvider.layer_norm), so
    without apex or TransformerEngine no spec can run sequence-parallel. What the apex norm adds is one
    attribute (fusions/fused_layer_norm.py): its weights are tagged `sequence_parallel`, because each TP
    rank then normalises only its slice of the sequence and the weight's gradient is a partial sum that
    must be summed over the TP group (services/trainer/optimizer.py does). The same tag here; the
    math is torch's norm, so parameter names and values are those of WrappedTorchNorm.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("layernorm_zero_centered_gamma / memory_efficient_layer_norm need apex or "
                             "TransformerEngine norms")
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: only {', '.join(kinds)} run on torch norms")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
