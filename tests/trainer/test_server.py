"""The Trainer gRPC service: a real two-rank group (TP 2, gloo) started by `python -m services.trainer serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from trainer_helpers import REPO, rank_env

from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.sequences import Sequences
from services.common.tensors import to_numpy, to_proto

KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "grad_norm",
        "actor/lr", "timing/update")


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


@pytest.fixture(scope="module")
def group(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("trainer_server")
    port_file = work / "port"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--log-level", "WARNING", "serve", "--hf-dir", str(tiny_model_dir),
         "--tp", "2", "--port-file", str(port_file), "--lr", "1e-4", "--kl-coef", "0.01", "--micro-batch-size", "2",
         "--forward-micro-batch-size", "4", "--grace-s", "10"],
        env=rank_env(), cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if launcher.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"trainer group did not start (exit {launcher.poll()})")
            time.sleep(0.2)
        ranks = sorted(_children(launcher.pid))
        channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}")
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "channel": channel, "ranks": ranks, "work": work,
               "launcher": launcher, "hf": tiny_model_dir}
        channel.close()
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()


def _batch(n: int, plen: int = 5, rlen: int = 4, version: int = 0, seed: int = 0) -> Sequences:
    rng = np.random.default_rng(seed)
    return Sequences.from_lists([f"s{seed}-{i}" for i in range(n)],
                                [rng.integers(0, 4096, plen) for _ in range(n)],
                                [rng.integers(0, 4096, rlen + i % 3) for i in range(n)], version)


def _hf_log_probs(model_dir: Path, seqs: Sequences, temperature: float) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, resp in seqs.split():
        ids = torch.from_numpy(np.concatenate([prompt, resp]).astype(np.int64))
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0] / temperature, -1)
        out.append(logp[len(prompt) - 1 : len(ids) - 1].gather(-1, ids[len(prompt):, None])[:, 0].numpy())
    return np.concatenate(out)


def test_info_describes_the_group(group):
    info = group["stub"].Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=30)
    assert (info.role, info.tensor_parallel_size, info.pipeline_parallel_size, info.data_parallel_size) == (
        "actor", 2, 1, 1)
    shards = {(s.name, s.tp_rank): s for s in info.shards}
    proj = shards[("decoder.layers.1.self_attention.linear_proj.weight", 1)]
    assert list(proj.shape) == [128, 64] and proj.partition_dim == 1
    assert shards[("decoder.final_layernorm.weight", 0)].partition_dim == -1


def test_log_probs_stream_matches_hf(group, tiny_model_dir):
    a, b = _batch(6, seed=1), _batch(3, seed=2)
    reqs = [trainer_pb2.LogProbRequest(batch=x.to_proto(), temperature=0.8, with_entropy=True) for x in (a, b)]
    replies = list(group["stub"].ComputeLogProbs(iter(reqs), timeout=60))
    assert [list(r.sample_ids) for r in replies] == [a.sample_ids, b.sample_ids]
    got = to_numpy(replies[0].log_probs)
    assert got.dtype == np.float32 and got.shape == (int(a.response_lengths.sum()),)
    assert np.abs(got - _hf_log_probs(tiny_model_dir, a, 0.8)).max() < 1e-5
    assert to_numpy(replies[1].entropy).shape == (int(b.response_lengths.sum()),)


def _update_request(seqs: Sequences, step: int, logp: np.ndarray | None = None) -> trainer_pb2.UpdateRequest:
    adv = np.linspace(-1, 1, len(seqs)).astype(np.float32)
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), advantages=to_proto(adv), temperature=1.0, step=step)
    if logp is not None:
        req.old_log_probs.CopyFrom(to_proto(logp))
        req.ref_log_probs.CopyFrom(to_proto(logp))
    return req


def test_update_checkpoint_offload(group):
    stub = group["stub"]
    seqs = _batch(4, seed=3)
    logp = to_numpy(next(stub.ComputeLogProbs(iter([trainer_pb2.LogProbRequest(batch=seqs.to_proto(),
                                                                               temperature=1.0)]), timeout=60)).log_probs)
    halves = [Sequences(seqs.sample_ids[:2], *_cut(seqs, 0, 2)), Sequences(seqs.sample_ids[2:], *_cut(seqs, 2, 4))]
    n0 = int(halves[0].response_lengths.sum())
    reqs = [_update_request(halves[0], 1, logp[:n0]), _update_request(halves[1], 1, logp[n0:])]
    for r, part in zip(reqs, (logp[:n0], logp[n0:]), strict=True):
        r.kl_coef = 0.05  # the coordinator's KL controller value overrides --kl-coef
        r.ref_log_probs.CopyFrom(to_proto(part - 0.1))
    reply = stub.Update(iter(reqs), timeout=60)
    assert set(KEYS) <= set(reply.metrics.values)
    assert reply.weights_version == 1 and reply.num_tokens == len(logp)
    assert reply.metrics.values["actor/lr"] == pytest.approx(1e-4)
    assert reply.metrics.values["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # old == current log-probs
    m = reply.metrics.values
    assert m["actor/kl_loss"] > 0
    assert m["actor/loss"] - m["actor/pg_loss"] == pytest.approx(0.05 * m["actor/kl_loss"], rel=1e-4)

    with pytest.raises(grpc.RpcError) as e:
        stub.Update(iter(reqs), timeout=60)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:  # generated by version 0, trainer now holds 1
        stub.Update(iter([_update_request(seqs, 2)]), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    bad = _update_request(_batch(4, version=1, seed=4), 2)
    bad.advantages.CopyFrom(to_proto(np.zeros(3, dtype=np.float32)))
    with pytest.raises(grpc.RpcError) as e:
        stub.Update(iter([bad]), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "advantages" in e.value.details()

    ck = group["work"] / "ckpt"
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(ck), iteration=1, consumed_samples=4),
                                timeout=60)
    assert saved.iteration == 1 and saved.consumed_samples == 4
    assert sorted(p.name for p in (ck / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "1"
    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(ck)), timeout=60)
    assert (loaded.iteration, loaded.consumed_samples) == (1, 4)
    fine = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(ck), finetune=True), timeout=60)
    assert fine.iteration == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(group["work"] / "none")), timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    from services.trainer.convert import convert_hf_to_mcore

    tp1 = convert_hf_to_mcore(group["hf"], group["work"] / "tp1", tp=1, pp=1)
    with pytest.raises(grpc.RpcError) as e:  # saved at TP 1, the group runs TP 2
        stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(tp1)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rlfabric convert" in e.value.details()

    probe = [trainer_pb2.LogProbRequest(batch=_batch(2, seed=7).to_proto(), temperature=1.0)]
    before = to_numpy(next(stub.ComputeLogProbs(iter(probe), timeout=60)).log_probs)
    off = stub.Offload(trainer_pb2.OffloadRequest(params=True, grads=True, optimizer=True), timeout=60)
    assert off.bytes > 0 and off.resident_bytes > 0
    with pytest.raises(grpc.RpcError) as e:  # the weights are out: no forward pass until Onload
        list(stub.ComputeLogProbs(iter(probe), timeout=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Onload" in e.value.details()
    on = stub.Onload(trainer_pb2.OnloadRequest(params=True, grads=True, optimizer=True), timeout=60)
    assert on.bytes == off.bytes and on.duration_s >= 0
    after = to_numpy(next(stub.ComputeLogProbs(iter(probe), timeout=60)).log_probs)
    assert np.array_equal(before, after)  # the same weights came back


def test_update_of_a_kl_trainer_without_reference_log_probs_is_refused(group):
    """A trainer whose loss has a KL term never trains without it: the call fails naming the missing field."""
    stub = group["stub"]
    before = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30)
    seqs = _batch(4, version=before.weights_version, seed=6)
    with pytest.raises(grpc.RpcError) as e:
        stub.Update(iter([_update_request(seqs, 100)]), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ref_log_probs" in e.value.details()
    after = stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30)
    assert (after.weights_version, after.iteration) == (before.weights_version, before.iteration)  # nothing applied


def _cut(seqs: Sequences, a: int, b: int):
    lens = seqs.prompt_lengths.astype(np.int64) + seqs.response_lengths
    off = np.concatenate([[0], np.cumsum(lens)])
    return (seqs.token_ids[off[a]:off[b]], seqs.prompt_lengths[a:b], seqs.response_lengths[a:b],
            seqs.weights_version)


def test_killed_rank_fails_the_call_within_its_deadline(group):
    """Runs last in this module: it breaks the group."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, rank1 = group["stub"], group["ranks"][1]
    big = _batch(64, plen=200, rlen=100, seed=5)
    req = trainer_pb2.LogProbRequest(batch=big.to_proto(), temperature=1.0)
    threading.Timer(0.5, lambda: os.kill(rank1, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ComputeLogProbs(iter([req] * 20), timeout=30))
    elapsed = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "rank" in e.value.details() and elapsed < 30
    with pytest.raises(grpc.RpcError) as e:  # later calls fail fast too
        stub.Offload(trainer_pb2.OffloadRequest(params=True), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(group["channel"])
    status = health.Check(health_pb2.HealthCheckRequest(service="rlfabric.v1.Trainer"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
