"""Per-rank memory accounting (services/trainer/memory.py) and the `memory/{role}/*` metrics of an Update.

Hand-computed bytes on tiny torch models first; then the activation peak of real Megatron models (one process
at TP 1 through every recompute variant, two gloo processes at TP 2 with and without sequence parallelism,
tests/trainer/memory_checks.py) against the arithmetic `rlfabric plan` uses; then a real trainer group whose
Update reply and Prometheus endpoint carry the metrics.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from trainer_helpers import run_ranks

from services.common.net import free_port
from services.planning.activations import MicroBatch, Recompute, TrainShape, stage_activations
from services.planning.arithmetic import ModelShape
from services.trainer import metrics as trainer_metrics
from services.trainer.memory import METRIC_NAMES, ActivationTracker, StateBytes, UpdateMemory, state_bytes

N = 8 * 16 + 16 + 16 * 4  # parameters of _mlp(): Linear(8, 16) with bias, Linear(16, 4) without


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False)).to(dtype)


def test_state_bytes_of_an_fp32_model_and_adamw_by_hand() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert state_bytes(model, opt) == StateBytes(params=4 * N, grads=0, master=0, optimizer_states=0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    # fp32 grads; Adam's two fp32 moments per parameter and one fp32 `step` per parameter tensor (3 tensors).
    got = state_bytes(model, opt)
    assert got == StateBytes(params=4 * N, grads=4 * N, master=0, optimizer_states=8 * N + 3 * 4)
    assert got.optimizer == 8 * N + 12 and got.total == 16 * N + 12


def test_mixed_precision_counts_master_weights_and_each_storage_once() -> None:
    model = _mlp(torch.bfloat16)
    params = list(model.parameters())
    buffer = torch.zeros(N, dtype=torch.float32)  # Megatron's contiguous fp32 grad buffer, one view per param
    offset = 0
    for p in params:
        p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    master = [p.detach().float().clone().requires_grad_() for p in params]
    for m, p in zip(master, params, strict=True):
        m.grad = p.main_grad  # the master weights' grads are the main grads themselves, not copies
    opt = torch.optim.AdamW(master, lr=1e-3)
    opt.step()

    class Wrapper:  # Megatron-style optimizer wrappers hold the torch optimizer as `.optimizer`
        optimizer = opt

    expected = StateBytes(params=2 * N, grads=4 * N, master=4 * N, optimizer_states=8 * N + 3 * 4)
    assert state_bytes(model, opt) == expected
    assert state_bytes(model, Wrapper()) == expected


def test_an_optimizer_that_knows_its_bytes_is_asked() -> None:
    model = _mlp()

    class Sharded:
        def memory_bytes(self) -> dict[str, int]:
            return {"grads": 100, "master": 7, "optimizer_states": 11}

    assert state_bytes(model, Sharded()) == StateBytes(params=4 * N, grads=100, master=7, optimizer_states=11)


def test_activation_tracker_by_hand() -> None:
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8)
    with ActivationTracker(lin) as act:
        y = torch.relu(lin(x))  # the matmul keeps x (128 B) and the weight (a parameter: not counted)
        z = (y * y).sum()  # relu keeps y; the product keeps y twice more: one storage, counted once
        assert act.current_bytes == 4 * 8 * 4 + 4 * 16 * 4
        z.backward()
    assert act.peak_bytes == 384 and act.current_bytes == 0  # backward released every saved tensor


def test_activation_tracker_peak_is_the_high_water_mark() -> None:
    w = torch.randn(32, 32, requires_grad=True)  # a leaf that requires grad: skipped without a model
    with ActivationTracker() as act:
        a = torch.randn(2, 32) @ w  # keeps its 256 B input
        first = (a.exp()).sum()  # keeps exp's output, 256 B
        first.backward()  # both released
        b = torch.randn(1, 32) @ w  # 128 B
        b.sum().backward()
    assert act.peak_bytes == 512 and act.current_bytes == 0


def test_a_storage_freed_while_saved_stops_counting() -> None:
    # Megatron's CheckpointWithoutOutput frees a saved output with resize_(0) and refills it in backward.
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationTracker() as act:
        y = (x * 1.0).exp()  # keeps its output: 128 B
        y.untyped_storage().resize_(0)
        z = (x * 1.0).sin()  # keeps its input: 128 B; the freed storage no longer counts
        assert act.current_bytes == 128
    assert act.peak_bytes == 128
    del y, z


def test_update_memory_metrics_on_cpu() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with UpdateMemory(model, opt) as mem:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    m = mem.metrics("actor")
    assert sorted(m) == sorted(f"memory/actor/{k}" for k in METRIC_NAMES)
    # Linear(8, 16) keeps its 64 B input; Linear(16, 4) keeps its 128 B input.
    assert m["memory/actor/activations_peak_bytes"] == 64 + 128
    assert m["memory/actor/params_bytes"] == 4 * N and m["memory/actor/grads_bytes"] == 4 * N
    assert m["memory/actor/optimizer_bytes"] == 8 * N + 12
    assert m["memory/actor/peak_bytes"] == 16 * N + 12 + 192  # no allocator on CPU: the accounting's sum


def test_prometheus_gauges_follow_an_update() -> None:
    from prometheus_client import REGISTRY

    trainer_metrics.observe_update({"memory/actor/params_bytes": 123.0, "memory/actor/peak_bytes": 456.0,
                                    "actor/pg_loss": 1.0})
    assert REGISTRY.get_sample_value("rlfabric_trainer_memory_bytes", {"role": "actor", "kind": "params"}) == 123
    assert REGISTRY.get_sample_value("rlfabric_trainer_memory_bytes", {"role": "actor", "kind": "peak"}) == 456


# ---- real Megatron models: the tracker against the plan's arithmetic ---------------------------------------


def _launch(world: int, tp: int, out: Path, timeout_s: float = 300) -> dict:
    run_ranks("memory_checks.py", world, ["--tp", str(tp), "--out", str(out)], timeout_s=timeout_s)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    work = tmp_path_factory.mktemp("memory_checks")
    runs = [_launch(1, 1, work / "tp1.json"), _launch(2, 2, work / "tp2.json")]
    return [{**r, "tp": run["tp"], "spec": run["spec"]} for run in runs for r in run["results"]]


def _predicted(r: dict) -> int:
    s, kw = r["spec"], r["memory"]
    shape = ModelShape(num_layers=s["num_hidden_layers"], hidden=s["hidden_size"], ffn=s["intermediate_size"],
                       heads=s["num_attention_heads"], kv_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
                       vocab=s["vocab_size"], tied=s["tie_word_embeddings"], qkv_bias=s["attention_bias"])
    rc = Recompute(kw.get("recompute_granularity"), kw.get("recompute_method") or "uniform",
                   kw.get("recompute_num_layers") or 1, kw.get("recompute_activation_function", False))
    ts = TrainShape(tp=r["tp"], sequence_parallel=r["sequence_parallel"],
                    act_bytes=4 if r["dtype"] == "float32" else 2, recompute=rc)  # CPU: unfused kernels
    return stage_activations(shape, MicroBatch(r["rows"], r["seq"], r["response"]), ts).saved_peak


def test_activation_peak_matches_the_plan_arithmetic(measured: list[dict]) -> None:
    cases = {(r["tp"], r["case"], r["dtype"]) for r in measured}
    assert {(1, "none", "bfloat16"), (1, "full_block_2", "float32"), (1, "activation", "float32"),
            (2, "sp", "float32"), (2, "sp_full", "float32")} <= cases
    for r in measured:
        assert r["peak"] > 0 and r["left"] == 0, r  # backward released everything it kept
        assert _predicted(r) == pytest.approx(r["peak"], rel=0.01), r


def test_activation_peak_grows_with_sequence_length_and_shrinks_with_recompute(measured: list[dict]) -> None:
    def peak(tp: int, case: str, seq: int) -> int:
        return next(r["peak"] for r in measured
                    if (r["tp"], r["case"], r["dtype"], r["rows"], r["seq"]) == (tp, case, "float32", 1, seq))

    assert peak(1, "none", 64) < peak(1, "none", 256)
    assert peak(1, "full_uniform_1", 64) < peak(1, "full_uniform_1", 256)
    assert peak(1, "full_uniform_1", 256) < 0.3 * peak(1, "none", 256)
    assert peak(1, "selective", 256) < peak(1, "none", 256)
    assert peak(2, "sp", 256) < peak(2, "none", 256) < peak(1, "none", 256)


# ---- a real trainer group: the metrics reach the Update reply and Prometheus ------------------------------


def test_update_reply_and_prometheus_carry_the_memory_metrics(start_trainer, tiny_model_dir: Path) -> None:
    from rlfabric.v1 import trainer_pb2, trainer_pb2_grpc
    from services.common.model_spec import read_hf_config
    from services.common.sequences import Sequences
    from services.common.tensors import to_proto
    from services.planning.arithmetic import rank_params

    metrics_port = free_port()
    launcher, address = start_trainer("--hf-dir", str(tiny_model_dir), "--tp", "1", "--lr", "1e-4", "--kl-coef",
                                      "0", "--micro-batch-size", "2", "--metrics-port", str(metrics_port))
    rng = np.random.default_rng(0)
    seqs = Sequences.from_lists([f"m{i}" for i in range(4)], [rng.integers(0, 4096, 6) for _ in range(4)],
                                [rng.integers(0, 4096, 5 + i) for i in range(4)], 0)
    req = trainer_pb2.UpdateRequest(batch=seqs.to_proto(), temperature=1.0, step=1,
                                    advantages=to_proto(np.linspace(-1, 1, 4).astype(np.float32)))
    with grpc.insecure_channel(address) as channel:
        reply = trainer_pb2_grpc.TrainerStub(channel).Update(iter([req]), timeout=120)
    m = reply.metrics.values
    spec, _ = read_hf_config(tiny_model_dir)
    n = rank_params(ModelShape.from_spec(spec), tp=1, pp=1, stage=0)
    assert m["memory/actor/params_bytes"] == 4 * n  # fp32 weights, counted from the tensors
    assert 4 * n <= m["memory/actor/grads_bytes"] <= 4 * n + 4096  # fp32 grads (a buffer may pad its buckets)
    assert 8 * n <= m["memory/actor/optimizer_bytes"] <= 8 * n + 4096  # Adam moments + step counters, no master
    assert m["memory/actor/activations_peak_bytes"] > 0
    parts = sum(m[f"memory/actor/{k}"] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                  "activations_peak_bytes"))
    assert m["memory/actor/peak_bytes"] == parts
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith('rlfabric_trainer_memory_bytes{kind="params"'))
    assert float(line.split()[-1]) == m["memory/actor/params_bytes"]
