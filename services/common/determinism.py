"""What `rlfabric.deterministic` does inside one process, and the seeding every trainer rank does.

A run is reproducible when every source of variation is pinned: the prompts (the loader's seeded shuffle), the
samples (per-sample seeds derived from `sampling_config.seed`, services/common/seeds.py), the order in which
samples enter each pass (the coordinator's, in sample order under `deterministic`), and the kernels. This module
owns the kernels' part and the host RNGs:

- `seed_host_rngs`: Python's `random`, NumPy's global generator and torch's CPU generator, as Megatron's
  `_set_random_seed` seeds them. A checkpoint saves all three (`rng_state`), so an unseeded one would make two
  otherwise identical checkpoints differ.
- `use_deterministic_kernels`: torch's deterministic algorithms; on CUDA cuBLAS needs a fixed workspace
  (`CUBLAS_WORKSPACE_CONFIG`, read when cuBLAS starts, so set before the first matmul) and TransformerEngine its
  deterministic kernels (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`); on Ascend HCCL its deterministic reductions
  (`HCCL_DETERMINISTIC`, what MindSpeed's `npu_deterministic` sets). Megatron's own `deterministic_mode` is set
  in the model's TransformerConfig (services/trainer/model.py).
- `batch_invariant_environment`: vLLM's batch-invariant kernels (`VLLM_BATCH_INVARIANT`), which exist for
  NVIDIA (compute capability 8.0+), AMD Instinct and Ascend A2/A3. On x86 CPUs vLLM's matmuls are MKL's, whose
  AVX-512 code picks its blocking by the number of rows, so a sample's log-probs move in the last bit with what
  else is batched (measured on an AVX-512/AMX Xeon; AVX2 hosts were invariant as they are): MKL's conditional
  numerical reproducibility (`MKL_CBWR=AVX2,STRICT`, read when MKL starts) pins one code path whose results do
  not depend on the batch (tests/rollout/test_batch_invariance.py), at ~1.6x the cost of a tiny model's matmul.
"""

from __future__ import annotations

import os
import platform
import random

import numpy as np


def seed_host_rngs(seed: int) -> None:
    import torch  # heavy: only the processes that train import it

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def use_deterministic_kernels() -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TransformerEngine, as Megatron's deterministic mode
    os.environ.setdefault("HCCL_DETERMINISTIC", "true")
    torch.use_deterministic_algorithms(True)


# MKL's batch-invariant code path on x86 (see the module docstring); also what the test process pins
MKL_BATCH_INVARIANT = {"MKL_CBWR": "AVX2,STRICT"}


def batch_invariant_environment(on_accelerator: bool) -> dict[str, str]:
    """The environment a vLLM engine reads for batch-invariant kernels (set before its first matmul)."""
    if on_accelerator:
        return {"VLLM_BATCH_INVARIANT": "1"}
    return dict(MKL_BATCH_INVARIANT) if platform.machine().lower() in ("x86_64", "amd64") else {}
