"""Whether this process has an accelerator: the one test the trainer's CPU patches and the rollout's
platform-only switches gate on."""

from __future__ import annotations

import torch


def accelerator_present() -> bool:
    """True when a CUDA GPU or an Ascend NPU (torch_npu) is usable in this process."""
    return torch.cuda.is_available() or npu_present()


def npu_present() -> bool:
    """True when an Ascend NPU (torch_npu) is usable: the platform where MindSpeed applies."""
    npu = getattr(torch, "npu", None)  # registered by torch_npu when installed
    try:
        return bool(npu is not None and npu.is_available())
    except (RuntimeError, AttributeError):
        return False
