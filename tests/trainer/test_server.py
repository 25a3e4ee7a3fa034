"""The Trainer gRPC service: a real two-rank group (TP 2, gloo) started by `rlfabric trainer serve`."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from rlfabric.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.processes import ServiceStartError
from services.common.sequences import Sequences
from services.common.tensors import to_numpy, to_proto

KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "grad_norm",
        "actor/lr", "timing/update")


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


@pytest.fixture(scope="module")
def group(start_trainer, tiny_model_dir: Path):
    launcher, address = start_trainer("--hf-dir", str(tiny_model_dir), "--tp", "2", "--lr", "1e-4", "--kl-coef", "0.01",
                                      "--micro-batch-size", "2", "--forward-micro-batch-size", "4")
    ranks = sorted(_children(launcher.proc.pid))
    channel = grpc.insecure_channel(address)
    try:
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "channel": channel, "ranks": ranks,
               "work": launcher.log_path.parent, "hf": tiny_model_dir, "launcher": launcher}
    finally:
        channel.close()
        launcher.stop(grace_s=12)


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
    assert info.dtype == common_pb2.DTYPE_FLOAT32
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


def test_a_refusal_names_each_rank_in_one_line_and_keeps_the_traceback_in_the_log(group):
    missing = group["work"] / "no-such-checkpoint"
    with pytest.raises(grpc.RpcError) as e:  # both ranks raise FileNotFoundError
        group["stub"].LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(missing)), timeout=60)
    details = e.value.details()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "rank 0: FileNotFoundError" in details and "rank 1: FileNotFoundError" in details
    assert "\n" not in details and "Traceback" not in details and 'File "' not in details
    log = (group["work"] / "trainer.log").read_text(errors="replace")
    assert "Traceback" in log and str(missing) in log  # the server's log keeps it
    assert log.count("auth: INSECURE") == 1  # `trainer serve --insecure` said so once (not again in rank 0)


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


def _version(stub) -> int:
    return stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).weights_version


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert len(e.value.details()) < 1000  # client values are cut, so the real code reaches the client
    return e.value


def test_out_of_vocabulary_ids_are_invalid_argument_naming_the_first(group):
    stub = group["stub"]
    seqs = _batch(3, seed=6)
    tokens = np.array(seqs.token_ids)
    tokens[7], tokens[12] = 5000, -1  # sequence 0 spans tokens [0, 9), sequence 1 [9, 19)
    bad = Sequences(["x" * 100_000, "b", "c"], tokens, seqs.prompt_lengths, seqs.response_lengths, _version(stub))
    logp = trainer_pb2.LogProbRequest(batch=bad.to_proto(), temperature=1.0)
    err = _refused(lambda: list(stub.ComputeLogProbs(iter([logp]), timeout=60)))
    assert "batch.token_ids[7] = 5000" in err.details() and "vocabulary of 4096 tokens" in err.details()
    assert "2 ids are" in err.details()
    err = _refused(lambda: stub.Update(iter([_update_request(bad, 50)]), timeout=60))
    assert "batch.token_ids[7] = 5000" in err.details()


def test_non_finite_inputs_are_refused_and_never_move_the_version(group):
    stub = group["stub"]
    version = _version(stub)
    seqs = _batch(4, version=version, seed=7)
    logp = np.full(int(seqs.response_lengths.sum()), -8.0, np.float32)  # the group has a KL term: ref needed
    nan_adv = _update_request(seqs, 60, logp)
    nan_adv.advantages.CopyFrom(to_proto(np.array([0.5, np.nan, -0.5, 1.0], np.float32)))
    assert "advantages[1] = nan" in _refused(lambda: stub.Update(iter([nan_adv]), timeout=60)).details()
    bad_logp = logp.copy()
    bad_logp[3] = -np.inf
    inf_old = _update_request(seqs, 60, bad_logp)
    assert "old_log_probs[3] = -inf" in _refused(lambda: stub.Update(iter([inf_old]), timeout=60)).details()
    nan_temperature = _update_request(seqs, 60, logp)
    nan_temperature.temperature = float("nan")
    assert "temperature" in _refused(lambda: stub.Update(iter([nan_temperature]), timeout=60)).details()
    req = trainer_pb2.LogProbRequest(batch=seqs.to_proto(), temperature=float("nan"))
    assert "temperature" in _refused(lambda: list(stub.ComputeLogProbs(iter([req]), timeout=60))).details()
    assert _version(stub) == version  # NaN advantages used to train (NaN losses) and bump the version

    # The refused step was not taken: the same step with good input trains.
    reply = stub.Update(iter([_update_request(seqs, 60, logp)]), timeout=60)
    assert reply.weights_version == version + 1
    assert all(np.isfinite(v) for v in reply.metrics.values.values())


def test_huge_client_values_do_not_hide_the_status_code(group):
    huge = "t" * 100_000
    req = trainer_pb2.PushWeightsRequest(version=_version(group["stub"]), targets=[huge, huge],
                                         plan=trainer_pb2.ReshardPlan())
    assert "duplicates" in _refused(lambda: list(group["stub"].PushWeights(req, timeout=60))).details()


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
    # The group then exits naming the rank (a launcher shows this line first, not a bare exit code).
    launcher = group["launcher"]
    assert launcher.proc.wait(timeout=120) == 128 + signal.SIGKILL
    with pytest.raises(ServiceStartError) as died:
        launcher.check()
    assert str(died.value).startswith(f"{launcher.name} (pid {launcher.pid}) exited with code 137: rank 1 (pid {rank1}) "
                                      "exited with code -9 (killed by SIGKILL); the group stops its other ranks; "
                                      "last lines of"), str(died.value)[:400]
