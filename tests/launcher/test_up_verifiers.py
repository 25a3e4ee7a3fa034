"""Custom verifiers for `rlfabric up` / `rlfabric eval`: flag parsing, and a launched server registered with a
real reward worker through its public RegisterVerifier RPC (the worker then scores with it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.launcher.verifiers import CustomVerifier, parse_command, parse_endpoint

VERIFIER = Path(__file__).resolve().parents[2] / "examples" / "grpo" / "leading_number_verifier.py"


def test_parse_endpoint() -> None:
    assert parse_endpoint("my_rule=127.0.0.1:50070") == CustomVerifier("my_rule", endpoint="127.0.0.1:50070")
    for bad in ("my_rule", "my_rule=127.0.0.1", "=127.0.0.1:5", "my_rule=host:port"):
        with pytest.raises(ValueError, match="NAME=HOST:PORT"):
            parse_endpoint(bad)


def test_parse_command() -> None:
    v = parse_command("my_rule=python my.py --port {port} --name 'a b'")
    assert v == CustomVerifier("my_rule", command=("python", "my.py", "--port", "{port}", "--name", "a b"))
    with pytest.raises(ValueError, match=r"\{port\}"):
        parse_command("my_rule=python my.py --port 5000")
    with pytest.raises(ValueError, match="NAME=COMMAND"):
        parse_command("python my.py {port}")


def test_up_refuses_a_duplicate_name() -> None:
    import argparse

    from services.launcher.cli import verifiers_from_args

    args = argparse.Namespace(verifier=["a=127.0.0.1:1"], verifier_command=["a=python x.py {port}"])
    with pytest.raises(ValueError, match="'a' is given more than once"):
        verifiers_from_args(args)


def test_a_launched_verifier_is_registered_and_scores(tmp_path: Path) -> None:
    from rlfabric.v1 import reward_pb2, reward_pb2_grpc
    from services.common.client import make_channel
    from services.launcher.stack import LocalStack

    command = parse_command(f"leading_number={sys.executable} {VERIFIER} --port {{port}}")
    stack = LocalStack(tmp_path, verifiers=[command], startup_timeout_s=300)
    try:
        stack.start_redis()
        stack.spawn_reward_workers(1, 1)
        stack.spawn_verifiers()
        stack.wait_ready()
        (worker,) = stack.endpoints("reward")
        with make_channel(worker) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            listed = {v.name: v for v in stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=30).verifiers}
            assert "leading_number" in listed and not listed["leading_number"].builtin
            spec = [reward_pb2.VerifierSpec(name="leading_number", weight=1.0)]
            requests = [reward_pb2.ScoreRequest(sample_id=f"s{i}", response=r, ground_truth="123", verifiers=spec)
                        for i, r in enumerate(["123", " 123 and more", "1234", "12"])]
            batch = reward_pb2.ScoreRequestBatch(requests=requests)
            rewards = {r.sample_id: r.reward for reply in stub.Score(iter([batch]), timeout=60)
                       for r in reply.responses}
        assert rewards == {"s0": 1.0, "s1": 1.0, "s2": 0.0, "s3": 0.0}
        assert (tmp_path / "logs" / "verifier-leading_number.log").is_file()
    finally:
        stack.stop()
    assert all(not p.alive() for p in stack.processes)


def test_a_running_verifier_is_registered_by_endpoint(tmp_path: Path) -> None:
    import subprocess

    from rlfabric.v1 import reward_pb2, reward_pb2_grpc
    from services.common.client import make_channel
    from services.common.net import free_port
    from services.launcher.stack import LocalStack

    port = free_port()
    server = subprocess.Popen([sys.executable, str(VERIFIER), "--port", str(port)], stdout=subprocess.DEVNULL)
    stack = LocalStack(tmp_path, verifiers=[parse_endpoint(f"sum_prefix=127.0.0.1:{port}")], startup_timeout_s=300)
    try:
        stack.start_redis()
        stack.spawn_reward_workers(2, 1)
        stack.spawn_verifiers()
        stack.wait_ready()
        for worker in stack.endpoints("reward"):  # every worker knows it before the run starts
            with make_channel(worker) as channel:
                listed = reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest(),
                                                                           timeout=30).verifiers
            assert any(v.name == "sum_prefix" and v.endpoint == f"127.0.0.1:{port}" for v in listed)
    finally:
        stack.stop()
        server.terminate()
        server.wait(timeout=30)
