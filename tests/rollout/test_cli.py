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
import yaml

from rlfabric.v1 import rollout_pb2, rollout_pb2_grpc
from services.cli import build_parser
from services.common.client import make_channel
from services.common.config import GenerateConfig, SamplingConfig
from services.common.errors import DataError
from services.rollout.cli import build_options, run_serve
from services.rollout.options import EngineOptions, SamplingOptions, options_from_config


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


# A config with every generate_config key at its default (and the few other keys validation needs, chosen so
# that those defaults pass: 8 heads and 8 devices for infer_tensor_parallel_size 8, bf16 for dtype bfloat16).
_DEFAULT_GENERATE_CONFIG = {
    "megatron_training": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "global_batch_size": 8,
                          "micro_batch_size": 1, "seq_length": 1024, "train_iters": 1, "lr": 1e-6, "bf16": True,
                          "attention_dropout": 0.0, "hidden_dropout": 0.0},
    "rl_config": {"actor_resource": {"num_npus": 8}, "mini_batch_size": 8},
}


def test_serve_without_config_takes_the_defaults_a_config_gives(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "defaults.yaml"
    path.write_text(yaml.safe_dump(_DEFAULT_GENERATE_CONFIG))
    parse = build_parser().parse_args
    with_config = build_options(parse(["rollout", "serve", "--config", str(path), "--model", str(tiny_model_dir)]))
    without = build_options(parse(["rollout", "serve", "--model", str(tiny_model_dir)]))
    assert without == with_config
    assert with_config[1].temperature == SamplingConfig().temperature  # the schema's, not a default of the rollout's


def test_option_defaults_are_the_schemas() -> None:
    # EngineOptions / SamplingOptions built bare hold what options_from_config reads from a default generate_config.
    engine, sampling = options_from_config(GenerateConfig(), "m")
    assert EngineOptions(model="m") == engine
    assert SamplingOptions() == sampling


def test_serve_without_model_says_what_to_pass() -> None:
    args = build_parser().parse_args(["rollout", "serve"])
    with pytest.raises(DataError, match="--model"):
        build_options(args)


def test_serve_refuses_a_max_tokens_the_engine_cannot_honour(tiny_model_dir: Path, capsys) -> None:
    # An engine of max_model_len 128 could never give 128 response tokens beside a prompt.
    args = build_parser().parse_args(["rollout", "serve", "--model", str(tiny_model_dir), "--max-model-len", "128",
                                      "--max-tokens", "128"])
    assert run_serve(args) == 2
    err = capsys.readouterr().err
    assert "max_tokens: 128 cannot be honoured: max_model_len=128" in err and "--max-tokens" in err


def test_serve_without_config_fits_max_tokens_to_a_short_engine(tiny_model_dir: Path) -> None:
    # Without a config the default max_tokens (128) would not fit --max-model-len 128: half the engine is used.
    parse = build_parser().parse_args
    _, sampling = build_options(parse(["rollout", "serve", "--model", str(tiny_model_dir), "--max-model-len", "128"]))
    assert sampling.max_tokens == 64
    _, sampling = build_options(parse(["rollout", "serve", "--model", str(tiny_model_dir)]))
    assert sampling.max_tokens == 128  # the engine's default 2048 positions leave room for the default
    _, sampling = build_options(parse(["rollout", "serve", "--model", str(tiny_model_dir), "--max-model-len", "128",
                                       "--max-tokens", "100"]))
    assert sampling.max_tokens == 100


def test_max_tokens_flag_overrides_the_config(repo_root: Path, tiny_model_dir: Path) -> None:
    args = build_parser().parse_args([
        "rollout", "serve", "--config", str(repo_root / "configs/grpo_qwen25_7b_A3.yaml"),
        "--model", str(tiny_model_dir), "--max-tokens", "300"])
    _, sampling = build_options(args)
    assert sampling.max_tokens == 300  # the config says 2048


def test_cli_serves_a_replica_at_version_zero(repo_root: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "rollout", "serve", "--model", str(tiny_model_dir),
         "--address", "127.0.0.1:0", "--dtype", "float32", "--tensor-parallel-size", "1", "--max-model-len", "256",
         "--max-num-seqs", "4", "--num-threads", "1"],
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
