"""Weight updates: bucket verification (no engine), then UpdateWeights into the live engine via gRPC."""

from __future__ import annotations

import copy

import grpc
import numpy as np
import pytest
import torch
from rollout_helpers import generate, group_request, hf_greedy, hf_token_log_probs, log_probs, prompts, tokens

from rlfabric.v1 import common_pb2, rollout_pb2
from services.common.checksum import combine_checksums
from services.common.transports.wire import CHECKSUM_TRAILER_BYTES
from services.rollout.weights import (
    ParamSpec,
    WeightDataLossError,
    WeightStager,
    WeightUpdateError,
    make_bucket,
)

SPECS = {"a.weight": ParamSpec((2, 3), torch.float32), "b.bias": ParamSpec((3,), torch.float32)}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(2, 3, generator=g), "b.bias": torch.randn(3, generator=g)}


def _commit(version: int, buckets: list[common_pb2.WeightBucket]) -> common_pb2.WeightCommit:
    return common_pb2.WeightCommit(version=version, num_buckets=len(buckets),
                                   checksum=combine_checksums([b.checksum for b in buckets]))


def test_stager_accepts_buckets_in_any_order_and_returns_the_values() -> None:
    t = _tensors()
    buckets = [make_bucket(3, 0, {"a.weight": t["a.weight"]}), make_bucket(3, 1, {"b.bias": t["b.bias"]})]
    stager = WeightStager(SPECS)
    stager.add_bucket(buckets[1])
    stager.add_bucket(buckets[0])
    stager.add_bucket(buckets[0])  # a retried bucket with the same bytes is harmless
    staged = stager.commit(_commit(3, buckets))
    assert staged.version == 3
    assert [n for n, _ in staged.tensors] == ["a.weight", "b.bias"]
    assert staged.names == ["a.weight", "b.bias"]  # what a backed-up apply saves first
    assert torch.equal(dict(staged.tensors)["a.weight"], t["a.weight"])
    assert staged.num_bytes == (6 + 3) * 4
    assert staged.checksum == combine_checksums([b.checksum for b in buckets])


def test_stager_casts_to_the_engine_dtype() -> None:
    bf16 = {k: v.to(torch.bfloat16) for k, v in _tensors().items()}
    bucket = make_bucket(1, 0, bf16)
    stager = WeightStager(SPECS)
    stager.add_bucket(bucket)
    staged = stager.commit(_commit(1, [bucket]))
    assert all(t.dtype == torch.float32 for _, t in staged.tensors)
    assert torch.equal(dict(staged.tensors)["b.bias"], bf16["b.bias"].float())


def test_corrupted_bucket_is_data_loss() -> None:
    bucket = make_bucket(1, 0, _tensors())
    bucket.checksum ^= 1
    with pytest.raises(WeightDataLossError, match="checksum"):
        WeightStager(SPECS).add_bucket(bucket)


def test_words_swapped_inside_a_tensor_are_data_loss() -> None:
    """All the bytes arrive, two 8-byte words of one tensor at each other's places: the checksum depends on
    each word's position (common.proto, WeightBucket.checksum)."""
    bucket = make_bucket(1, 0, _tensors())
    data = bucket.tensors[0].tensor.data  # a.weight: 24 bytes, three words
    bucket.tensors[0].tensor.data = data[16:24] + data[8:16] + data[0:8]
    with pytest.raises(WeightDataLossError, match="checksum") as err:
        WeightStager(SPECS).add_bucket(bucket)
    assert err.value.code == "DATA_LOSS"


def test_missing_bucket_is_data_loss() -> None:
    b0 = make_bucket(1, 0, {"a.weight": _tensors()["a.weight"]})
    b1 = make_bucket(1, 1, {"b.bias": _tensors()["b.bias"]})
    stager = WeightStager(SPECS)
    stager.add_bucket(b0)
    with pytest.raises(WeightDataLossError, match=r"buckets \[1\]"):
        stager.commit(_commit(1, [b0, b1]))


def test_wrong_combined_checksum_is_data_loss() -> None:
    bucket = make_bucket(1, 0, _tensors())
    stager = WeightStager(SPECS)
    stager.add_bucket(bucket)
    bad = _commit(1, [bucket])
    bad.checksum ^= 1
    with pytest.raises(WeightDataLossError, match="combined checksum"):
        stager.commit(bad)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"c.weight": torch.zeros(2, 3)}, "unknown parameter 'c.weight'"),
        ({"a.weight": torch.zeros(3, 2)}, r"shape \(3, 2\)"),
        ({"a.weight": torch.zeros(2, 3, dtype=torch.int32)}, "non-float"),
    ],
)
def test_bad_names_shapes_dtypes_are_invalid_argument(tensors, message) -> None:
    with pytest.raises(WeightUpdateError, match=message) as err:
        WeightStager(SPECS).add_bucket(make_bucket(1, 0, tensors))
    assert err.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_invalid_argument_naming_the_tensor(bad) -> None:
    t = _tensors()
    t["b.bias"][1] = bad
    with pytest.raises(WeightUpdateError, match=r"parameter 'b.bias' has 1 non-finite values .* flat index 1") as err:
        WeightStager(SPECS).add_bucket(make_bucket(1, 0, t))
    assert err.value.code == "INVALID_ARGUMENT"


def test_values_the_engine_dtype_cannot_hold_are_refused() -> None:
    # Finite in float32, inf once cast to the engine's float16: it would poison the engine all the same.
    specs = {"b.bias": ParamSpec((3,), torch.float16)}
    with pytest.raises(WeightUpdateError, match="non-finite"):
        WeightStager(specs).add_bucket(make_bucket(1, 0, {"b.bias": torch.tensor([1.0, 1e5, 2.0])}))


def test_a_version_below_the_served_one_is_failed_precondition() -> None:
    with pytest.raises(WeightUpdateError, match="only move forward") as err:
        WeightStager(SPECS, held_version=5).add_bucket(make_bucket(4, 0, _tensors()))
    assert err.value.code == "FAILED_PRECONDITION"
    stager = WeightStager(SPECS, held_version=5)  # the same version again is a retry: accepted
    stager.add_bucket(make_bucket(5, 0, _tensors()))


def test_mixed_versions_and_duplicate_names_are_refused() -> None:
    t = _tensors()
    stager = WeightStager(SPECS)
    stager.add_bucket(make_bucket(1, 0, {"a.weight": t["a.weight"]}))
    with pytest.raises(WeightUpdateError, match="version 2"):
        stager.add_bucket(make_bucket(2, 1, {"b.bias": t["b.bias"]}))
    with pytest.raises(WeightUpdateError, match="already arrived"):
        stager.add_bucket(make_bucket(1, 1, {"a.weight": t["a.weight"]}))


# The offset, from the end of an encoded bucket, of its last tensor's last byte.
_LAST_DATA_BYTE = -CHECKSUM_TRAILER_BYTES - 1


def _received(version: int, tensors: dict[str, torch.Tensor], flip: int | None = None):
    """One bucket as the replica receives it over gRPC: tensor bytes kept as views (wire.ReceivedChunk),
    optionally with the byte at offset `flip` of the serialized message inverted."""
    from services.common.transports.grpc_stream import GrpcStreamTransport
    from services.common.transports.wire import decode_chunk, serialize

    (chunk, _), = list(GrpcStreamTransport(["x:1"]).buckets(version, iter(tensors.items())))
    raw = bytearray(serialize(chunk))
    if flip is not None:
        raw[flip] ^= 0xFF
    return decode_chunk(bytes(raw))


def test_streamed_buckets_are_checked_next_to_the_stream_and_a_bad_one_fails_the_commit() -> None:
    t = _tensors()
    good = _received(1, t)
    stager = WeightStager(SPECS)
    stager.add_bucket(good.bucket, good.data)
    staged = stager.commit(_commit(1, [good.bucket]))
    assert [n for n, _ in staged.tensors] == ["a.weight", "b.bias"]
    assert all(torch.equal(v, t[n]) for n, v in staged.tensors)
    # The message ends with b.bias's bytes, then the bucket checksum (wire.CHECKSUM_TRAILER_BYTES): its last
    # byte of data changed, only the checksum can tell.
    bad = _received(1, t, flip=_LAST_DATA_BYTE)
    stager = WeightStager(SPECS)
    stager.add_bucket(bad.bucket, bad.data)  # checked on the verifier thread: the stream goes on
    with pytest.raises(WeightDataLossError, match="bucket 0 of version 1: checksum"):
        stager.commit(_commit(1, [bad.bucket]))
    t["b.bias"][2] = float("nan")
    nan = _received(1, t)
    stager = WeightStager(SPECS)
    stager.add_bucket(nan.bucket, nan.data)
    with pytest.raises(WeightUpdateError, match=r"parameter 'b.bias' has 1 non-finite values .* flat index 2") as err:
        stager.commit(_commit(1, [nan.bucket]))
    assert err.value.code == "INVALID_ARGUMENT"


def test_a_taken_bucket_yields_each_tensor_once_checked_and_never_a_bad_one() -> None:
    t = _tensors()
    t["b.bias"][0] = float("inf")
    stager = WeightStager(SPECS)
    chunk = _received(2, t)
    stager.add_bucket(chunk.bucket, chunk.data)
    taken = stager.take(0)
    assert len(taken.tensors) == 2 and taken.num_bytes == (6 + 3) * 4
    got = []
    with pytest.raises(WeightUpdateError, match="'b.bias' has 1 non-finite"):
        for name, tensor in taken.tensors:
            got.append(name)
            assert torch.equal(tensor, t[name])
    assert got == ["a.weight"]  # the engine never sees the bad tensor
    with pytest.raises(WeightUpdateError, match="non-finite"):
        stager.commit(_commit(2, [chunk.bucket]))  # and the commit refuses the update
    # A checksum mismatch is only known after the bucket's last tensor: the taken bucket raises then.
    stager = WeightStager(SPECS)
    bad = _received(2, _tensors(), flip=_LAST_DATA_BYTE)
    stager.add_bucket(bad.bucket, bad.data)
    with pytest.raises(WeightDataLossError, match="checksum"):
        list(stager.take(0).tensors)
    with pytest.raises(WeightDataLossError, match="checksum"):
        stager.add_bucket(*(lambda c: (c.bucket, c.data))(_received(2, {"b.bias": _tensors()["b.bias"]})))


# --- through gRPC, into the running engine ------------------------------------------------------------


def _checkpoint_state(model) -> dict[str, torch.Tensor]:
    """HF names as in the checkpoint (a tied LM head is not a checkpoint tensor)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}


def _update_chunks(version: int, state: dict[str, torch.Tensor], per_bucket: int = 7):
    names = list(state)
    buckets = [make_bucket(version, i, {n: state[n] for n in names[s:s + per_bucket]})
               for i, s in enumerate(range(0, len(names), per_bucket))]
    chunks = [rollout_pb2.WeightUpdateChunk(bucket=b) for b in buckets]
    chunks.append(rollout_pb2.WeightUpdateChunk(commit=_commit(version, buckets)))
    return chunks, buckets


def test_update_weights_then_greedy_equals_transformers_on_the_same_weights(rollout_stub, rollout_engine,
                                                                            hf_model) -> None:
    original = _checkpoint_state(hf_model)
    perturbed_model = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(11)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    perturbed_model.load_state_dict(perturbed, strict=False)
    perturbed_model.tie_weights()

    base = rollout_engine.weights_version
    new, newer = base + 1, base + 2
    chunks, buckets = _update_chunks(new, perturbed)
    try:
        ack = rollout_stub.UpdateWeights(iter(chunks), timeout=120)
        assert ack.version == new
        assert ack.checksum == combine_checksums([b.checksum for b in buckets])
        assert ack.num_tensors == len(perturbed)
        assert ack.num_bytes == sum(v.numel() * 4 for v in perturbed.values())
        assert ack.duration_s > 0

        batch = prompts(3, seed=5)
        samples = generate(rollout_stub, [group_request(f"q{i}", p, version=new, temperature=0.0, max_tokens=12)
                                          for i, p in enumerate(batch)])
        for s in samples:
            prompt = batch[int(s.group_id[1:])]
            expected = hf_greedy(perturbed_model, prompt, 12)
            assert tokens(s) == expected
            assert s.weights_version == new
            np.testing.assert_allclose(log_probs(s), hf_token_log_probs(perturbed_model, prompt, expected),
                                       atol=1e-4)
        # The original weights answer differently: the update really changed what the engine computes.
        assert any(tokens(s) != hf_greedy(hf_model, batch[int(s.group_id[1:])], 12) for s in samples)

        # A corrupted update changes nothing: still `new` served.
        bad_chunks, _ = _update_chunks(newer, original)
        bad_chunks[0].bucket.checksum ^= 0xFF
        with pytest.raises(grpc.RpcError) as err:
            rollout_stub.UpdateWeights(iter(bad_chunks), timeout=60)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert rollout_engine.weights_version == new

        # A stream without its commit applies nothing either.
        with pytest.raises(grpc.RpcError) as err:
            rollout_stub.UpdateWeights(iter(bad_chunks[1:-1]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rollout_engine.weights_version == new
    finally:
        # Put the checkpoint's weights back (as a newer version) for the other tests.
        restore, _ = _update_chunks(newer, original)
        assert rollout_stub.UpdateWeights(iter(restore), timeout=120).version == newer

    # The replica now holds `newer`: a caller still expecting `new` is refused.
    with pytest.raises(grpc.RpcError) as err:
        generate(rollout_stub, [group_request("old", batch[0], version=new, temperature=0.0)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    samples = generate(rollout_stub, [group_request("back", batch[0], version=newer, temperature=0.0,
                                                    max_tokens=12)])
    assert tokens(samples[0]) == hf_greedy(hf_model, batch[0], 12)


def test_unknown_parameter_is_invalid_argument(rollout_stub, rollout_engine) -> None:
    version = rollout_engine.weights_version
    chunks, _ = _update_chunks(version + 1, {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(grpc.RpcError) as err:
        rollout_stub.UpdateWeights(iter(chunks), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "qkv_proj" in err.value.details()
    assert rollout_engine.weights_version == version


def test_update_weights_refuses_going_backwards_and_non_finite_values(rollout_stub, rollout_engine, hf_model) -> None:
    original = _checkpoint_state(hf_model)
    prompt = prompts(1, seed=6)[0]
    before = tokens(generate(rollout_stub, [group_request("nan0", prompt, temperature=0.0, max_tokens=8)])[0])
    held = rollout_engine.weights_version + 2
    chunks, _ = _update_chunks(held, original)  # the checkpoint's own weights: nothing changes for other tests
    assert rollout_stub.UpdateWeights(iter(chunks), timeout=120).version == held

    behind, _ = _update_chunks(held - 1, original)
    with pytest.raises(grpc.RpcError) as err:
        rollout_stub.UpdateWeights(iter(behind), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"below the version this replica serves ({held})" in err.value.details()
    assert rollout_engine.weights_version == held

    poisoned = dict(original)
    poisoned["model.norm.weight"] = original["model.norm.weight"].clone()
    poisoned["model.norm.weight"][3] = float("nan")
    bad, _ = _update_chunks(held + 1, poisoned)
    with pytest.raises(grpc.RpcError) as err:
        rollout_stub.UpdateWeights(iter(bad), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'model.norm.weight'" in err.value.details() and "non-finite" in err.value.details()
    assert rollout_engine.weights_version == held
    after = tokens(generate(rollout_stub, [group_request("nan1", prompt, temperature=0.0, max_tokens=8)])[0])
    assert after == before
