"""`rlfabric rollout serve`: options from a MindSpeed-RL YAML, and a real replica started by the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from services.cli import build_parser
from services.common.client import make_channel
from services.rollout.cli import build_options, run_serve


def test_options_come_from_generate_config(repo_root: Path, tiny_model_dir: Path) -> None:
    args = build_parser().parse_args([
        "rollout", "serve", "--config", str(repo_root / "configs/grpo_qwen25_7b_A3.yaml"),
        "--model", str(tiny_model_dir), "--set", "generate_config.max_num_seqs=48", "--dtype", "float32",
    ])
    engine, sampling = build_options(args)
    # Values of configs/grpo_qwen25_7b_A3.yaml's generate_config, with the two overrides.
    assert engine.model == str(tiny_model_dir)
    assert engine.tensor_parallel_size == 1
    assert engine.max_num_seqs == 48
    assert engine.max_model_len == 4096
    assert engine.max_num_batched_tokens == 8192
    assert engine.dtype == "float32"
    assert engine.gpu_memory_utilization == 0.4
    assert engine.trust_remote_code is True
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        2048, 1.0, 1.0, -1, 0.0)
    assert sampling.logprobs == 1


def test_serve_without_model_says_what_to_pass() -> None:
    args = build_parser().parse_args(["rollout", "serve"])
    with pytest.raises(SystemExit, match="--model"):
        build_options(args)


def test_serve_refuses_a_max_tokens_the_engine_cannot_honour(tiny_model_dir: Path) -> None:
    # Default sampling max_tokens is 128: an engine of max_model_len 128 could never give that many.
    args = build_parser().parse_args(["rollout", "serve", "--model", str(tiny_model_dir), "--max-model-len", "128"])
    with pytest.raises(SystemExit, match=r"max_tokens: 128 cannot be honoured: max_model_len=128"):
        run_serve(args)


def test_cli_serves_a_replica_at_version_zero(repo_root: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "rollout", "serve", "--model", str(tiny_model_dir),
         "--address", "127.0.0.1:0", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
         "--num-threads", "1"],
        cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr.log", "w"), text=True,
    )
    try:
        match = None
        for line in proc.stdout:  # vLLM logs to stdout too; ends when the process dies
            match = re.search(r"rollout serving on (\S+)", line)
            if match:
                break
        assert match, f"no address printed; stderr:\n{(tmp_path / 'stderr.log').read_text()[-3000:]}"
        with make_channel(match.group(1)) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            info = stub.Info(rollout_pb2.RolloutInfoRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as refused:  # no --auth-token-file, no --insecure: fails closed
                stub.Sleep(rollout_pb2.SleepRequest(), timeout=30)
        assert info.weights_version == 0  # a (re)started replica must be re-synced before it serves a run
        assert info.model == str(tiny_model_dir)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        first = (tmp_path / "stderr.log").read_text().splitlines()[0]
        assert "auth: closed" in first and "Sleep, UpdateWeights, Wake refuse every caller" in first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
