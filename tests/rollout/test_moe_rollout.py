"""The rollout service on a tiny Qwen3-MoE: greedy equals transformers', MoE weight pushes (HF per-expert
names into vLLM's fused experts) land exactly, and each sample carries the experts every MoE layer chose.

One MoE engine for the module (with routed-experts capture on), served over real gRPC like the dense one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from rollout_helpers import generate, group_request, hf_greedy, hf_token_log_probs, log_probs, prompts, tokens

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import combine_checksums
from services.common.tensors import to_numpy
from services.rollout.weights import make_bucket

MAX_NEW = 12


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def moe_stub(moe_engine) -> Iterator:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel
    from services.rollout.options import SamplingOptions
    from services.rollout.server import create_rollout_server

    server, _ = create_rollout_server(moe_engine, SamplingOptions(max_tokens=16, temperature=1.0), metrics_port=0)
    server.start()
    channel = make_channel(server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()
    server.stop(0)


def _push(stub, version: int, state: dict[str, torch.Tensor], per_bucket: int = 9, corrupt_last: bool = False):
    names = list(state)
    buckets = [make_bucket(version, i, {n: state[n] for n in names[s:s + per_bucket]})
               for i, s in enumerate(range(0, len(names), per_bucket))]
    commit = rollout_pb2.WeightUpdateChunk(commit=common_pb2.WeightCommit(
        version=version, num_buckets=len(buckets), checksum=combine_checksums([b.checksum for b in buckets])))
    if corrupt_last:
        buckets[-1].checksum ^= 0xFF
    chunks = [rollout_pb2.WeightUpdateChunk(bucket=b) for b in buckets] + [commit]
    return stub.UpdateWeights(iter(chunks), timeout=120)


def _assert_greedy_matches(stub, hf, version: int, batch: list[list[int]]) -> list[list[int]]:
    samples = generate(stub, [group_request(f"q{i}", p, version=version, temperature=0.0, max_tokens=MAX_NEW)
                              for i, p in enumerate(batch)])
    got = {int(s.group_id[1:]): s for s in samples}
    for i, prompt in enumerate(batch):
        expected = hf_greedy(hf, prompt, MAX_NEW)
        assert tokens(got[i]) == expected
        # the replica captures routing: every sample brings its experts over the wire (one row per computed
        # position, both MoE layers, top-2 experts each)
        routed = to_numpy(got[i].routed_experts)
        assert routed.shape == (len(prompt) + len(expected) - 1, 2, 2) and 0 <= routed.min() and routed.max() < 8
        np.testing.assert_allclose(log_probs(got[i]), hf_token_log_probs(hf, prompt, expected), atol=1e-4)
    return [tokens(got[i]) for i in range(len(batch))]


def _assert_engine_holds(engine, state: dict[str, torch.Tensor]) -> None:
    held = engine.read_weights(list(state))
    differing = [n for n, t in state.items() if held[n] is None or not torch.equal(held[n], t)]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"


def test_moe_greedy_and_log_probs_equal_transformers(moe_stub, moe_engine, moe_dirs) -> None:
    assert "cpu_moe_experts_keep_plain_layout" in moe_engine.patches or not moe_engine.is_cpu
    shapes = moe_engine.engine_parameter_shapes()
    assert shapes["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (8, 128, 128)  # [E, 2I, H]
    continuations = _assert_greedy_matches(moe_stub, _hf(moe_dirs[0]), moe_engine.weights_version, prompts(4))
    assert len({tuple(c) for c in continuations}) > 1 and any(len(set(c)) > 1 for c in continuations)
    _assert_engine_holds(moe_engine, _checkpoint(moe_dirs[0]))  # the read-back itself is exact


def test_a_moe_weight_push_lands_exactly_and_a_failed_one_is_undone(moe_stub, moe_engine, moe_dirs) -> None:
    seed0, seed1 = _checkpoint(moe_dirs[0]), _checkpoint(moe_dirs[1])
    assert any(".experts.7.down_proj." in n for n in seed1) and "model.layers.1.mlp.gate.weight" in seed1
    base = moe_engine.weights_version
    batch = prompts(4, seed=3)
    try:
        ack = _push(moe_stub, base + 1, seed1)
        assert (ack.version, ack.num_tensors) == (base + 1, len(seed1))
        _assert_engine_holds(moe_engine, seed1)
        hf1 = _hf(moe_dirs[1])
        pushed = _assert_greedy_matches(moe_stub, hf1, base + 1, batch)
        assert pushed != [hf_greedy(_hf(moe_dirs[0]), p, MAX_NEW) for p in batch]  # the push changed the model

        # Every expert tensor has its place in the fused parameters: later pushes copy them in directly.
        placed = moe_engine._call(lambda: moe_engine._engine.apply_model(
            lambda m: set(m._rlfabric_placements._views))[0])
        assert {n for n in seed1 if ".experts." in n} <= placed

        # A push whose last bucket is corrupted fails after the others were applied: the experts it wrote
        # are put back from the backup, bitwise.
        with pytest.raises(grpc.RpcError) as err:
            _push(moe_stub, base + 2, seed0, corrupt_last=True)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert moe_engine.weights_version == base + 1
        _assert_engine_holds(moe_engine, seed1)
        assert _assert_greedy_matches(moe_stub, hf1, base + 1, batch[:2]) == pushed[:2]
    finally:
        assert _push(moe_stub, base + 3, seed0).version == base + 3
    _assert_engine_holds(moe_engine, seed0)


def test_each_sample_carries_the_experts_transformers_routes_to(moe_engine, moe_dirs) -> None:
    import threading

    from services.rollout.options import SamplingOptions
    from services.rollout.samples import SampleRequest

    assert (moe_engine.routed_expert_layers, moe_engine.routed_experts_top_k) == ([0, 1], 2)
    batch = prompts(3, seed=7)
    results, done = {}, threading.Event()

    def finished(result) -> None:
        results[result.request_id] = result
        if len(results) == len(batch):
            done.set()

    for i, p in enumerate(batch):
        moe_engine.submit(SampleRequest(f"route{i}", p, SamplingOptions(max_tokens=MAX_NEW, temperature=0.0)),
                          finished)
    assert done.wait(120)
    hf = _hf(moe_dirs[0])
    for i, prompt in enumerate(batch):
        r = results[f"route{i}"]
        routed = r.routed_experts
        sequence = list(prompt) + r.response_token_ids.tolist()
        assert routed.dtype == np.int32 and routed.shape == (len(sequence) - 1, 2, 2)
        with torch.no_grad():
            logits = hf(torch.tensor([sequence[:-1]]), output_router_logits=True).router_logits
        expected = np.stack([lg.reshape(len(sequence) - 1, -1).topk(2, dim=-1).indices.numpy() for lg in logits],
                            axis=1)
        np.testing.assert_array_equal(np.sort(routed, axis=-1), np.sort(expected, axis=-1))
        assert routed[r.prompt_length - 1:].shape[0] == len(r.response_token_ids)  # one row per response token


def test_routed_experts_with_the_prefix_cache_is_refused(moe_dirs, tmp_path: Path) -> None:
    from services.rollout.engine import RolloutEngine
    from services.rollout.options import EngineOptions

    with pytest.raises(ValueError, match="return_routed_experts needs enable_prefix_caching off"):
        RolloutEngine(EngineOptions(model=str(moe_dirs[0]), dtype="float32", tensor_parallel_size=1,
                                    cache_root=str(tmp_path), return_routed_experts=True, enable_prefix_caching=True))
