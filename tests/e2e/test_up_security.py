"""Security of `rlfabric up` (issue 12): probed from outside while the run trains, as an attacker on the same host
would. Unauthenticated mutating calls to the coordinator, trainer and rollout are refused UNAUTHENTICATED and the
run still completes; even with the token, a checkpoint outside the run's directories and a weight push to an
unregistered host:port are refused; Redis wants its password; no secret is on any command line; the trainer's
sockets are bound to loopback. One run does it all with `--tls` (the service token guards the same methods
with and without TLS; every other `up` of the suite runs the default, plaintext with the token): a plaintext
client gets no answer, one that verifies the run's CA does. The soak also runs it without TLS.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import redis

from rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.common.client import make_channel

DENIED = grpc.StatusCode.UNAUTHENTICATED
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def start_up(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "services.cli", "up", "configs/grpo_tiny_cpu.yaml",
            "-o", f"megatron_training.tokenizer_name_or_path={tiny_model_dir}",
            "-o", f"megatron_training.data_path={arith_prefix}",
            "-o", f"actor_config.load={tiny_model_dir}", "-o", f"actor_config.save={run_dir / 'ckpt'}",
            "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(args, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_line(proc: subprocess.Popen, prefix: str, seen: list[str], timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"`up` never printed {prefix!r}:\n{''.join(seen)}")


def finish(proc: subprocess.Popen, seen: list[str], timeout_s: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return "".join(seen) + out


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user would: `up` stops the run and every child (SIGKILL would leave them behind)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def probe_unauthenticated(coordinator: str, trainer: str, rollout: str, run_id: str, ca: str | None) -> None:
    with make_channel(coordinator, token=None, tls_ca=ca) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert code_of(lambda: stub.StopRun(coordinator_pb2.StopRunRequest(run_id=run_id), timeout=30)) == DENIED
        assert stub.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id), timeout=30).run_id == run_id  # read-only
    with make_channel(trainer, token=None, tls_ca=ca) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        update = iter([trainer_pb2.UpdateRequest(step=10**6, temperature=1.0)])
        assert code_of(lambda: stub.Update(update, timeout=30)) == DENIED
        save = trainer_pb2.SaveCheckpointRequest(dir="/tmp/rlfabric-attack", iteration=1)
        assert code_of(lambda: stub.SaveCheckpoint(save, timeout=30)) == DENIED
        assert stub.Info(trainer_pb2.TrainerInfoRequest(), timeout=30).role == "actor"
    with make_channel(rollout, token=None, tls_ca=ca) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        chunk = iter([rollout_pb2.WeightUpdateChunk(commit=common_pb2.WeightCommit(version=10**6))])
        assert code_of(lambda: stub.UpdateWeights(chunk, timeout=30)) == DENIED
        assert code_of(lambda: stub.Sleep(rollout_pb2.SleepRequest(), timeout=30)) == DENIED


def probe_with_token(trainer: str, token: str, run_dir: Path, tmp_path: Path, ca: str | None) -> None:
    with make_channel(trainer, token=token, tls_ca=ca) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        outside = tmp_path / "outside"
        with pytest.raises(grpc.RpcError) as e:
            stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(dir=str(outside), iteration=1), timeout=60)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and str(outside) in e.value.details()
        assert not outside.exists()
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(dir="/etc"), timeout=60)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "/etc" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.PushWeights(trainer_pb2.PushWeightsRequest(version=10**6, targets=["203.0.113.7:9"]),
                                  timeout=60))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "203.0.113.7:9" in e.value.details()


def check_tls(coordinator: str, ca: str) -> None:
    with make_channel(coordinator, token=None, tls_ca=None) as ch:  # plaintext never gets an answer
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert code_of(lambda: stub.GetRun(coordinator_pb2.GetRunRequest(run_id="x"), timeout=5)) in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    with make_channel(coordinator, token=None, tls_ca=ca) as ch:  # TLS, verified against the run's CA
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert code_of(lambda: stub.GetRun(coordinator_pb2.GetRunRequest(run_id="x"), timeout=30)) == (
            grpc.StatusCode.NOT_FOUND)


def check_processes(proc: subprocess.Popen, secrets: list[str]) -> None:
    children = descendants(proc)
    assert children
    for child in children:
        try:
            cmdline = " ".join(child.cmdline())
            listening = [c.laddr for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
        assert not any(s in cmdline for s in secrets), f"a secret on the command line of {cmdline[:200]}"
        if " trainer " in cmdline:
            assert all(a.ip in LOOPBACK for a in listening), (cmdline[:120], listening)


@pytest.mark.parametrize("tls", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_up_refuses_unauthenticated_calls_and_completes(repo_root: Path, tiny_model_dir: Path, arith_prefix: Path,
                                                        tmp_path: Path, tls: bool) -> None:
    from services.common.redis_store import Registry, connect

    run_dir = tmp_path / "up"
    # A run longer than the probes take (a 2-iteration run could end first on a quiet machine, and with it the
    # services); it is stopped by an authenticated StopRun once a checkpoint is written.
    proc = start_up(repo_root, tiny_model_dir, arith_prefix, run_dir, "-o", "megatron_training.train_iters=1000",
                    "-o", "megatron_training.save_interval=2", *(["--tls"] if tls else []))
    seen: list[str] = []
    try:
        coordinator = wait_for_line(proc, "services up; coordinator at ", seen).rsplit(" ", 1)[1]
        ca = str(run_dir / "secrets" / "ca.crt") if tls else None
        if tls:
            check_tls(coordinator, ca)
        run_id = wait_for_line(proc, "run ", seen).split()[1]
        secrets_dir = run_dir / "secrets"
        assert secrets_dir.stat().st_mode & 0o077 == 0
        token = (secrets_dir / "token").read_text().strip()
        url = (secrets_dir / "redis-url").read_text().strip()
        registry = Registry(connect(url))
        (trainer,) = [m.endpoint for m in registry.members("trainer") if m.metadata.get("role") == "actor"]
        (rollout,) = [m.endpoint for m in registry.members("rollout")]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(redis.exceptions.AuthenticationError):  # no password: no registry writes
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).set("rlfabric:members:reward:fake", "{}")
        probe_unauthenticated(coordinator, trainer, rollout, run_id, ca)
        probe_with_token(trainer, token, run_dir, tmp_path, ca)
        check_processes(proc, [token, url.split("@")[0].split(":")[-1]])
        wait_for_line(proc, "iteration 2/", seen)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: `up` stops the run (StopRun with the run's token), then it all
        out = finish(proc, seen)
    finally:
        stop(proc)
    assert proc.returncode == 130, out
    stopped = re.search(rf"run {run_id} stopped at iteration (\d+) of 1000; the last iteration logged here: (\d+)",
                        out)
    assert stopped, out[-3000:]
    at, logged = int(stopped.group(1)), int(stopped.group(2))
    assert at >= logged >= 2, (at, logged)  # the stop may finish the iteration that was going
    assert f"resume it with: rlfabric up configs/grpo_tiny_cpu.yaml --resume --run-id {run_id} --run-dir {run_dir}" \
        in out, out[-3000:]
    saved = int((run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and saved % 2 == 0, saved
