"""The shared-memory transport against the real rollout server: bitwise delivery, segment reuse, and no
/dev/shm segment left behind after a success, a failure, or a crashed sender."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from weight_sync_helpers import assert_engine_holds, placed_names, restore_checkpoint_weights

from rlfabric.v1 import rollout_pb2
from services.common.transports import ShmTransport, TargetFailure, WeightAck, shm
from services.trainer.convert import load_hf_state

BUCKET = 256 << 10  # several buckets for the tiny model


def _ours() -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(f"{shm.SEGMENT_PREFIX}{os.getpid()}-*"))


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in load_hf_state(model_dir).items()}


@pytest.fixture()
def replica(rollout_engine, rollout_server, tiny_model_dir):
    yield rollout_engine, rollout_server[0].address
    restore_checkpoint_weights(rollout_server[0].address, tiny_model_dir)
    shm._close_current()
    assert _ours() == []


def test_push_is_bitwise_reuses_its_segment_and_leaves_no_name(replica, tiny_model_dir):
    engine, address = replica
    segment_ids = set()
    for i in range(2):
        state = _perturbed(tiny_model_dir, i)
        version = engine.weights_version + 1
        transport = ShmTransport([address], bucket_bytes=BUCKET, timeout_s=60)
        out = transport.send(version, iter(state.items()))
        assert isinstance(out[address], WeightAck) and out[address].version == version, out
        assert out[address].num_tensors == len(state)
        assert engine.weights_version == version
        assert_engine_holds(engine, state)
        assert _ours() == []  # the name is gone; both sides keep their mapping
        segment_ids.add(transport.segment.id)
    assert len(segment_ids) == 1  # the second push rewrote the mapped segment instead of faulting in a new one
    # vLLM's loader put every tensor whole into its parameter, so the second push copied them all itself
    # (checks riding along) and still holds them bitwise.
    assert placed_names(engine) == set(state)


def test_a_failed_push_leaves_the_replica_refusing_to_serve_until_a_complete_one(replica, tiny_model_dir):
    engine, address = replica
    before = engine.weights_version
    good = _perturbed(tiny_model_dir, 7)
    assert isinstance(ShmTransport([address], bucket_bytes=BUCKET).send(before + 1, iter(good.items()))[address],
                      WeightAck)
    first = shm._CURRENT[0].id

    def corrupt(_target, chunk):
        if chunk.HasField("bucket") and chunk.bucket.index == 1:
            chunk = rollout_pb2.WeightUpdateChunk.FromString(chunk.SerializeToString())
            chunk.bucket.checksum ^= 1
        return chunk

    bad = _perturbed(tiny_model_dir, 8)
    out = ShmTransport([address], bucket_bytes=BUCKET, tamper=corrupt).send(before + 2, iter(bad.items()))
    assert isinstance(out[address], TargetFailure) and out[address].code == "DATA_LOSS", out
    assert engine.weights_version == before + 1
    # Bucket 0 was applied before bucket 1 failed its check (shm applies bucket by bucket): no half-new
    # weights are ever served, the replica refuses until a complete update lands.
    assert "inconsistent" in engine.unavailable_reason()
    assert _ours() == [] and shm._CURRENT == []  # dropped: the next push writes a fresh segment
    transport = ShmTransport([address], bucket_bytes=BUCKET)
    assert isinstance(transport.send(before + 3, iter(bad.items()))[address], WeightAck)
    assert transport.segment.id != first
    assert engine.unavailable_reason() is None and engine.weights_version == before + 3
    assert_engine_holds(engine, bad)


def test_a_replica_that_cannot_map_the_segment_refuses_with_failed_precondition(replica, tiny_model_dir):
    engine, address = replica
    before = engine.weights_version

    def elsewhere(_target, chunk):
        if chunk.HasField("bucket"):
            chunk = rollout_pb2.WeightUpdateChunk.FromString(chunk.SerializeToString())
            chunk.bucket.shm.path = str(shm.SHM_DIR / f"{shm.SEGMENT_PREFIX}1-missing")
            chunk.bucket.shm.segment_id = "1-missing"
        return chunk

    out = ShmTransport([address], tamper=elsewhere).send(before + 1, iter(load_hf_state(tiny_model_dir).items()))
    assert isinstance(out[address], TargetFailure) and out[address].code == "FAILED_PRECONDITION", out
    assert "same host" in out[address].message or "/dev/shm" in out[address].message
    assert engine.weights_version == before and _ours() == []


def test_segments_of_a_crashed_sender_are_swept():
    code = textwrap.dedent("""
        import os, sys
        from services.common.transports.shm import Segment
        seg = Segment(1 << 20)
        print(seg.path, flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = shm.Path(proc.stdout.strip())
    assert path.exists()  # a crash skips every cleanup path
    removed = shm.sweep_stale_segments()
    assert path in removed and not path.exists()
    mine = shm.Segment(4096)
    try:
        assert mine.path not in shm.sweep_stale_segments()  # a live creator's segment stays
    finally:
        mine.close()
    assert not mine.path.exists()


def test_an_unreachable_target_fails_and_drops_the_segment():
    out = ShmTransport(["127.0.0.1:9"], timeout_s=10).send(1, iter({"x": torch.zeros(4)}.items()))
    assert isinstance(out["127.0.0.1:9"], TargetFailure) and out["127.0.0.1:9"].code == "UNAVAILABLE"
    assert _ours() == [] and shm._CURRENT == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="targets is empty"):
        ShmTransport([])
    with pytest.raises(ValueError, match="duplicates"):
        ShmTransport(["a:1", "a:1"])
