"""The one place where rlfabric works round Megatron-core's CUDA-only code paths on a CPU-only host.

Megatron-core 0.16.1 assumes an accelerator in a handful of spots that a dense GPT training step
touches. On a machine without CUDA or an Ascend NPU this module makes those spots run on the CPU;
with an accelerator present every entry point here is a no-op (or the upstream call, unchanged),
so the normal NCCL / HCCL path is never altered.

Entry points:
    accelerator_present()      -> bool: the gate every patch checks.
    apply_cpu_patches()        -> bool: idempotent, process-wide; True when patches were applied
                                 (also keeps freed host memory for reuse: memory.keep_freed_memory).
    seed_model_parallel_rng(s) : Megatron's model-parallel seeding, CPU-safe.
    cpu_device_mode()          : context in which tensors that Megatron allocates with
                                 ``device="cuda"`` are created on the CPU instead.

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

from services.common import memory

logger = logging.getLogger(__name__)

_PATCHED = False


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU (torch_npu) is usable in this process."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)  # registered by torch_npu when installed
    try:
        return bool(npu is not None and npu.is_available())
    except (RuntimeError, AttributeError):
        return False


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
    # Not Megatron's code but the same CPU-only step: on a GPU the caching allocator reuses the
    # activations' memory between micro-batches; on the CPU glibc would unmap (and page-fault again) every
    # block over 32 MiB, which made the W1 update cost per token double from 64 to 128 response tokens.
    memory.keep_freed_memory()
    _PATCHED = True
    logger.info("megatron_compat: no accelerator, CPU patches applied")
    return True


def patches_applied() -> bool:
    """Whether apply_cpu_patches() changed this process."""
    return _PATCHED


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_synchronize(device: object = None) -> None:
    return None


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's RNG tracker for this rank (call after parallel_state is initialised)."""
    from megatron.core import tensor_parallel

    if accelerator_present():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    # Upstream: megatron/core/tensor_parallel/random.py, model_parallel_cuda_manual_seed ->
    # CudaRNGStatesTracker.add -> torch.cuda.get_rng_state, which asserts CUDA. Attention always
    # enters `get_cuda_rng_tracker().fork()` (dot_product_attention.py), so a tracker must exist:
    # the inference tracker is a no-op one, which is exact because rlfabric trains with dropout 0
    # (see model.py). The CPU generator is seeded as Megatron seeds the data-parallel state.
    torch.manual_seed(seed)
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
