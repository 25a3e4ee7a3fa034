"""Weight-sync fixtures: ONE vLLM rollout server per session (same engine options as tests/rollout), and
trainer groups started as real processes by `python -m services.trainer serve`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from weight_sync_helpers import REPO, rank_env, serve_rollout

MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def rollout_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    pytest.importorskip("vllm")
    from services.rollout.engine import EngineOptions, RolloutEngine

    engine = RolloutEngine(EngineOptions(
        model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        num_threads=1, cpu_kv_cache_gib=1, cache_root=str(tmp_path_factory.mktemp("vllm_cache")),
    ))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def rollout_server(rollout_engine) -> Iterator:
    server = serve_rollout(rollout_engine)
    yield server
    server.stop(0)


@pytest.fixture()
def rollout_stub(rollout_server) -> Iterator:
    from rlfabric.v1 import rollout_pb2_grpc
    from services.common.client import make_channel

    channel = make_channel(rollout_server.address)
    yield rollout_pb2_grpc.RolloutStub(channel)
    channel.close()


def start_trainer(hf_dir: Path, work: Path, tp: int, pp: int = 1) -> tuple[subprocess.Popen, str]:
    """`python -m services.trainer serve` with tp x pp gloo ranks; returns the launcher and rank 0's address."""
    port_file = work / "port"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--log-level", "WARNING", "serve", "--hf-dir", str(hf_dir),
         "--tp", str(tp), "--pp", str(pp), "--port-file", str(port_file), "--lr", "1e-2", "--micro-batch-size", "4",
         "--forward-micro-batch-size", "4", "--grace-s", "5"],
        env=rank_env(), cwd=REPO,
    )
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            stop_trainer(launcher)
            pytest.fail(f"trainer group did not start (exit {launcher.poll()})")
        time.sleep(0.2)
    return launcher, f"127.0.0.1:{port_file.read_text()}"


def stop_trainer(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def trainer(request, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, rollout_server) -> Iterator[dict]:
    from rlfabric.v1 import trainer_pb2_grpc

    tp, pp = request.param
    work = tmp_path_factory.mktemp(f"trainer_tp{tp}_pp{pp}")
    launcher, address = start_trainer(tiny_model_dir, work, tp, pp)
    channel = grpc.insecure_channel(address)
    try:
        yield {"stub": trainer_pb2_grpc.TrainerStub(channel), "tp": tp, "pp": pp, "work": work, "address": address,
               "rollout_address": rollout_server.address}
    finally:
        channel.close()
        stop_trainer(launcher)
