"""The Trainer service with PPO's critic: ComputeValues, the critic's Update, and what each role refuses.

Two ways in: the servicer in this process (a real gRPC server over `create_trainer_server`, its worker and group a
stand-in that records the operations it is asked to run), for the status codes and the arrays each call hands the
ranks; and a real critic group (`rlfabric trainer serve --role critic`, TP 2, gloo) for the values and an update.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from rlfabric.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.sequences import Sequences
from services.common.tensors import to_numpy, to_proto
from services.trainer.server import create_trainer_server

CRITIC_KEYS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "timing/update_critic"}
PPO = ["megatron_training.stage=ray_ppo", "rl_config.adv_estimator=gae", "critic_config.lr=5e-6",
       "critic_config.micro_batch_size=2", "critic_config.tensor_model_parallel_size=2"]


def _batch(n: int, seed: int = 0, version: int = 0) -> Sequences:
    rng = np.random.default_rng(seed)
    return Sequences.from_lists([f"s{seed}-{i}" for i in range(n)], [rng.integers(0, 4096, 5) for _ in range(n)],
                                [rng.integers(0, 4096, 3 + i % 3) for i in range(n)], version)


def _f32(x) -> common_pb2.Tensor:
    return to_proto(np.asarray(x, dtype=np.float32))


def critic_request(seqs: Sequences, step: int, **fields) -> trainer_pb2.UpdateRequest:
    n = int(seqs.response_lengths.sum())
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), step=step, returns=_f32(np.linspace(-1, 1, n)),
                                    values=_f32(np.zeros(n)))
    for name, value in fields.items():
        if value is None:
            req.ClearField(name)
        else:
            getattr(req, name).CopyFrom(_f32(value))
    return req


def actor_request(seqs: Sequences, step: int, **fields) -> trainer_pb2.UpdateRequest:
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), step=step, temperature=1.0)
    for name, value in fields.items():
        getattr(req, name).CopyFrom(_f32(value))
    return req


# ----------------------------------------------------------------------------- the servicer in this process


class StandInGroup:
    """The group executor: records each operation and answers as the ranks would (rank 0's result)."""

    def __init__(self, worker) -> None:
        self.worker, self.calls = worker, []

    def run(self, op: str, timeout_s, **kwargs):
        self.calls.append((op, kwargs))
        if op == "values":
            return torch.arange(int(np.sum(kwargs["response_lengths"])), dtype=torch.float32)
        if op == "update":
            self.worker.last_update_step = kwargs["step"]
            self.worker.weights_version += 1
            return {"critic/vf_loss": 0.5} if self.worker.opts.role == "critic" else {"actor/pg_loss": 0.1}
        raise AssertionError(f"the servicer ran {op}")


def stand_in_worker(role: str):
    return types.SimpleNamespace(
        opts=types.SimpleNamespace(role=role, lora=None, update=types.SimpleNamespace(max_staleness=0),
                                   params_dtype="float32"),
        spec=types.SimpleNamespace(vocab_size=4096, moe=None), weights_version=0, last_update_step=None, iteration=0,
        layout=types.SimpleNamespace(tp=1, pp=1, dp=1))


@pytest.fixture
def serve():
    servers = []

    def start(role: str):
        worker = stand_in_worker(role)
        group = StandInGroup(worker)
        server, _ = create_trainer_server(group, worker, metrics_port=None)
        servers.append(server.start())
        channel = grpc.insecure_channel(server.address)
        servers.append(channel)
        return trainer_pb2_grpc.TrainerStub(channel), group

    yield start
    for s in reversed(servers):
        s.close() if isinstance(s, grpc.Channel) else s.stop(grace_s=0)


def refused(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    assert all(w in e.value.details() for w in words), e.value.details()
    return e.value.details()


def test_compute_values_streams_one_reply_per_request(serve):
    stub, group = serve("critic")
    a, b = _batch(3, seed=1), _batch(2, seed=2)
    replies = list(stub.ComputeValues(iter([trainer_pb2.ValueRequest(batch=x.to_proto()) for x in (a, b)]), timeout=10))
    assert [list(r.sample_ids) for r in replies] == [a.sample_ids, b.sample_ids]
    got = to_numpy(replies[0].values)
    assert got.dtype == np.float32 and got.shape == (int(a.response_lengths.sum()),) and replies[1].weights_version == 0
    op, kwargs = group.calls[1]
    assert op == "values" and set(kwargs) == {"token_ids", "prompt_lengths", "response_lengths", "routed_experts"}
    assert np.array_equal(kwargs["response_lengths"], b.response_lengths)


def test_a_critic_update_hands_the_ranks_returns_and_values_only(serve):
    stub, group = serve("critic")
    a, b = _batch(3, seed=1, version=7), _batch(2, seed=2, version=7)  # the policy's version: the critic has no fence
    reqs = [critic_request(a, 1), critic_request(b, 1)]
    reqs[1].temperature = 0.0  # the critic reads no temperature
    reply = stub.Update(iter(reqs), timeout=10)
    assert set(reply.metrics.values) == {"critic/vf_loss", "timing/update_critic"}
    assert reply.weights_version == 1 and reply.num_tokens == int(a.response_lengths.sum() + b.response_lengths.sum())
    op, kwargs = group.calls[0]
    assert op == "update" and kwargs["step"] == 1 and "temperature" not in kwargs and "kl_coef" not in kwargs
    assert not {"advantages", "token_advantages", "old_log_probs", "ref_log_probs"} & set(kwargs)
    n0 = int(a.response_lengths.sum())
    assert np.array_equal(kwargs["returns"][:n0], to_numpy(reqs[0].returns))
    assert np.array_equal(kwargs["values"][n0:], to_numpy(reqs[1].values))
    refused(lambda: stub.Update(iter(reqs), timeout=10), grpc.StatusCode.ALREADY_EXISTS, "step 1 already applied")


@pytest.mark.parametrize(("fields", "words"), [
    ({"returns": None}, ["returns is missing"]),
    ({"values": None}, ["values is missing"]),
    ({"advantages": [1.0, 0.0, -1.0]}, ["advantages is set", "critic"]),
    ({"token_advantages": np.zeros(12)}, ["token_advantages is set"]),
    ({"old_log_probs": np.zeros(12)}, ["old_log_probs is set"]),
    ({"ref_log_probs": np.zeros(12)}, ["ref_log_probs is set"]),
    ({"returns": np.full(12, np.nan)}, ["returns[0]", "not finite"]),
    ({"values": np.zeros(5)}, ["values has 5 values for 12 response tokens"]),
])
def test_a_malformed_critic_update_is_invalid_argument_before_any_rank_works(serve, fields: dict, words: list[str]):
    stub, group = serve("critic")
    seqs = _batch(3, seed=1)
    assert int(seqs.response_lengths.sum()) == 12
    refused(lambda: stub.Update(iter([critic_request(seqs, 1, **fields)]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert group.calls == []


def test_an_actor_update_takes_token_advantages(serve):
    stub, group = serve("actor")
    seqs = _batch(3, seed=1)
    adv = np.linspace(-1, 1, 12)
    reply = stub.Update(iter([actor_request(seqs, 1, token_advantages=adv)]), timeout=10)
    assert "timing/update" in reply.metrics.values and "timing/update_critic" not in reply.metrics.values
    _, kwargs = group.calls[0]
    assert kwargs["advantages"] is None and np.array_equal(kwargs["token_advantages"], adv.astype(np.float32))
    assert (kwargs["temperature"], kwargs["kl_coef"]) == (1.0, 0.0)


@pytest.mark.parametrize(("fields", "words"), [
    ({}, ["advantages is missing", "token_advantages"]),
    ({"advantages": [1.0, 0.0, -1.0], "token_advantages": np.zeros(12)}, ["both set"]),
    ({"advantages": [1.0, 0.0, -1.0], "returns": np.zeros(12)}, ["returns is set", "critic's"]),
    ({"token_advantages": np.zeros(12), "values": np.zeros(12)}, ["values is set"]),
    ({"token_advantages": np.zeros(11)}, ["token_advantages has 11 values for 12 response tokens"]),
    ({"token_advantages": np.full(12, np.inf)}, ["token_advantages[0]", "not finite"]),
])
def test_a_malformed_actor_update_is_invalid_argument(serve, fields: dict, words: list[str]):
    stub, group = serve("actor")
    refused(lambda: stub.Update(iter([actor_request(_batch(3, seed=1), 1, **fields)]), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert group.calls == []


def test_a_call_mixing_both_kinds_of_advantages_over_its_requests_is_refused(serve):
    stub, _ = serve("actor")
    a, b = _batch(2, seed=1), _batch(2, seed=2)
    reqs = [actor_request(a, 1, advantages=[0.5, -0.5]),
            actor_request(b, 1, token_advantages=np.zeros(int(b.response_lengths.sum())))]
    refused(lambda: stub.Update(iter(reqs), timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "both set")


def test_each_role_refuses_the_rpcs_of_the_others_as_failed_precondition(serve):
    seqs = _batch(2, seed=3)
    for role in ("actor", "reference"):
        stub, group = serve(role)
        refused(lambda stub=stub: list(stub.ComputeValues(iter([trainer_pb2.ValueRequest(batch=seqs.to_proto())]),
                                                          timeout=10)),
                grpc.StatusCode.FAILED_PRECONDITION, "ComputeValues", f"the {role}", "critic")
        assert group.calls == []
    stub, group = serve("reference")
    refused(lambda: stub.Update(iter([actor_request(seqs, 1, advantages=[1.0, -1.0])]), timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION, "Update", "the reference does not train")
    stub, group = serve("critic")
    refused(lambda: list(stub.ComputeLogProbs(iter([trainer_pb2.LogProbRequest(batch=seqs.to_proto(),
                                                                               temperature=1.0)]), timeout=10)),
            grpc.StatusCode.FAILED_PRECONDITION, "ComputeLogProbs", "the critic")
    refused(lambda: list(stub.PushWeights(trainer_pb2.PushWeightsRequest(version=1, targets=["127.0.0.1:1"]),
                                          timeout=10)),
            grpc.StatusCode.FAILED_PRECONDITION, "PushWeights", "the critic")
    assert group.calls == []
    assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=10).role == "critic"


# ----------------------------------------------------------------------------- command line and config


def test_trainer_serve_takes_the_critic_role_and_its_config_section(repo_root: Path, tmp_path: Path, capsys):
    from services.trainer.cli import add_group_arguments
    from services.trainer.launch import _worker_options, checkpoint_roots, serve_group

    parser = argparse.ArgumentParser()
    add_group_arguments(parser)
    config = str(repo_root / "configs/grpo_tiny_cpu.yaml")
    args = parser.parse_args(["--role", "critic", "--config", config, "--insecure",
                              *[a for o in [*PPO, f"critic_config.save={tmp_path}/critic"] for a in ("--override", o)]])
    opts, _, tp, pp = _worker_options(args)
    assert (opts.role, tp, pp, opts.forward_micro_batch_size) == ("critic", 2, 1, 2)
    assert Path(tmp_path / "critic").resolve() in checkpoint_roots(args, opts)
    # a critic without critic_config: one line, exit 2, before any rank starts
    bare = parser.parse_args(["--role", "critic", "--config", config, "--insecure"])
    bare.threads, bare.world_size, bare.nnodes, bare.node_rank = 1, None, 1, 0
    assert serve_group(bare) == 2
    assert "critic_config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "judge"])


# ----------------------------------------------------------------------------- a real critic group


@pytest.fixture(scope="module")
def critic_group(start_trainer, tiny_model_dir: Path, redis_url: str):
    launcher, address = start_trainer("--hf-dir", str(tiny_model_dir), "--role", "critic", "--tp", "2", "--lr", "2e-5",
                                      "--micro-batch-size", "2", "--forward-micro-batch-size", "3",
                                      "--redis-url", redis_url)
    channel = grpc.insecure_channel(address)
    try:
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "work": launcher.log_path.parent, "address": address}
    finally:
        channel.close()


def test_a_critic_group_registers_as_the_critic(critic_group, redis_url: str):
    import time

    from services.common.redis_store import Registry, connect
    from services.common.service_kind import ServiceKind

    registry = Registry(connect(redis_url))
    port = critic_group["address"].rsplit(":", 1)[1]
    deadline = time.monotonic() + 30  # rank 0 registers just after it starts serving
    mine = []
    while not mine and time.monotonic() < deadline:
        mine = [m for m in registry.members(ServiceKind.TRAINER) if m.endpoint.endswith(f":{port}")]
        time.sleep(0.2)
    assert len(mine) == 1 and mine[0].metadata["role"] == "critic" and mine[0].metadata["tp"] == 2


def _hf_values(model_dir: Path, seqs: Sequences, weight: torch.Tensor, bias: torch.Tensor) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, resp in seqs.split():
        ids = torch.from_numpy(np.concatenate([prompt, resp]).astype(np.int64))
        with torch.no_grad():
            hidden = model.model(ids[None]).last_hidden_state[0]
        out.append((hidden[len(prompt) - 1 : len(ids) - 1] @ weight.T + bias)[:, 0].numpy())
    return np.concatenate(out)


def test_a_critic_group_computes_values_and_trains(critic_group, tiny_model_dir: Path):
    stub, work = critic_group["stub"], critic_group["work"]
    info = stub.Info(trainer_pb2.TrainerInfoRequest(include_parameters=True), timeout=30)
    assert (info.role, info.tensor_parallel_size) == ("critic", 2)
    assert {s.name for s in info.shards} >= {"value_head.weight", "value_head.bias"}
    seqs = _batch(6, seed=4)

    def values() -> np.ndarray:
        return to_numpy(next(stub.ComputeValues(iter([trainer_pb2.ValueRequest(batch=seqs.to_proto())]),
                                                timeout=60)).values)

    before = values()
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(work / "ckpt"), iteration=1), timeout=60)
    state = torch.load(Path(saved.path) / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    expected = _hf_values(tiny_model_dir, seqs, state["value_head.weight"], state["value_head.bias"])
    assert np.abs(before - expected).max() < 1e-5

    n = int(seqs.response_lengths.sum())
    returns = before + np.float32(0.3)
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), step=1, returns=_f32(returns), values=_f32(before))
    reply = stub.Update(iter([req]), timeout=120)
    assert CRITIC_KEYS <= set(reply.metrics.values) and not any(k.startswith("actor/") for k in reply.metrics.values)
    assert reply.metrics.values["critic/vf_loss"] == pytest.approx(0.5 * 0.09, rel=1e-4)  # 0.5 * mean(0.3^2)
    assert reply.metrics.values["critic/lr"] == pytest.approx(2e-5) and reply.metrics.values["critic/grad_norm"] > 0
    assert reply.weights_version == 1 and reply.num_tokens == n
    after = values()
    # the step moved the values toward their returns (inside the clip range: the loss has a gradient there)
    assert np.mean(after - before) > 0.005 and 0.5 * np.mean((after - returns) ** 2) < 0.5 * 0.09

    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir=str(work / "ckpt")), timeout=60)
    assert loaded.iteration == 1 and np.array_equal(values(), before)  # the saved head and backbone came back
    stub.Offload(trainer_pb2.OffloadRequest(params=True), timeout=60)
    refused(lambda: values(), grpc.StatusCode.FAILED_PRECONDITION, "Onload")
    stub.Onload(trainer_pb2.OnloadRequest(params=True), timeout=60)
    assert np.array_equal(values(), before)
    refused(lambda: list(stub.ComputeLogProbs(iter([trainer_pb2.LogProbRequest(batch=seqs.to_proto(),
                                                                               temperature=1.0)]), timeout=60)),
            grpc.StatusCode.FAILED_PRECONDITION, "the critic")
