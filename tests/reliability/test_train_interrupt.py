"""Ctrl-C on `rlfabric train` following a run on a coordinator (real `coordinator serve` and `train` processes).

The first Ctrl-C asks the coordinator to stop the run (StopRun: after its current phase) and waits for it; a
second one, while that stop is still in progress, leaves at once. Either way `train` exits 130 (128 + SIGINT)
and leaves nothing running, and the run ends on the coordinator. Before, Ctrl-C left at once and the run went on;
a StopRun that came while the run waited for its services (discovery) waited out the whole discovery timeout.

The run's services are only what the registry says: none (the run waits in discovery), or trainers and a
rollout replica whose endpoint is a TCP listener that accepts and never answers (a hung peer), so the run's
first call to them, and with it the stop, stays in progress until the listener closes.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.processes import ServiceProcess, wait_until
from services.common.redis_store import Registry, connect, start_private_redis
from tests.console import ConsoleProcess

TERMINAL = {coordinator_pb2.RUN_PHASE_STOPPED, coordinator_pb2.RUN_PHASE_FAILED, coordinator_pb2.RUN_PHASE_DONE}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory, repo_root: Path):
    """(address, registry) of a `coordinator serve` on a Redis of its own (its registry is the test's to fill)."""
    redis = start_private_redis()
    work = tmp_path_factory.mktemp("train_interrupt")
    proc = ServiceProcess("coordinator", [
        "coordinator", "serve", "--redis-url", redis.url, "--address", "127.0.0.1:0", "--runs-dir",
        str(work / "runs"), "--instance-id", "interrupt-coordinator", "--discovery-timeout", "900", "--insecure"],
        work / "coordinator.log", env={"PYTHONPATH": str(repo_root)}).start()
    registry = Registry(connect(redis.url))
    try:
        wait_until(lambda: registry.members("coordinator"), [proc], 120, "coordinator registration")
        yield registry.members("coordinator")[0].endpoint, registry
    finally:
        proc.stop()
        redis.stop()


class Train(ConsoleProcess):
    """`rlfabric train` on the tiny config against `address`, its output collected on a thread."""

    def __init__(self, repo_root: Path, address: str, run_id: str, tiny_model_dir: Path, arith_prefix: Path) -> None:
        super().__init__("train", [
            sys.executable, "-m", "services.cli", "train", "configs/grpo_tiny_cpu.yaml", "--coordinator", address,
            "--run-id", run_id, "-o", f"megatron_training.tokenizer_name_or_path={tiny_model_dir}",
            "-o", f"megatron_training.data_path={arith_prefix}"], repo_root)

    def wait_for(self, pattern: str, timeout_s: float = 120) -> re.Match:
        return super().wait_for(pattern, timeout_s)

    def exit_code(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"train did not exit within {timeout_s}s of the Ctrl-C:\n{self.output}")


def phase(address: str, run_id: str) -> int:
    from services.common.client import make_channel

    with make_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id), timeout=30).phase


def test_ctrl_c_stops_a_run_still_waiting_for_its_services(coordinator, repo_root, tiny_model_dir,
                                                           arith_prefix) -> None:
    address, _ = coordinator
    train = Train(repo_root, address, "interrupt-discovery", tiny_model_dir, arith_prefix)
    train.wait_for(r"run interrupt-discovery started")
    train.proc.send_signal(signal.SIGINT)
    # The stop is answered after the discovery's next poll, not after its 900 s timeout.
    assert train.exit_code(timeout_s=60) == 130, train.output
    assert "interrupted: stopping run interrupt-discovery" in train.output
    assert "run interrupt-discovery stopped at iteration 0\n" in train.output
    assert phase(address, "interrupt-discovery") == coordinator_pb2.RUN_PHASE_STOPPED


def test_a_second_ctrl_c_while_the_stop_is_in_progress_leaves_at_once(coordinator, repo_root, tiny_model_dir,
                                                                      arith_prefix) -> None:
    address, registry = coordinator
    hung = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
    with registry.register("trainer", "hung-actor", endpoint, metadata={"role": "actor"}), \
            registry.register("trainer", "hung-reference", endpoint, metadata={"role": "reference"}), \
            registry.register("rollout", "hung-rollout", endpoint):
        train = Train(repo_root, address, "interrupt-stopping", tiny_model_dir, arith_prefix)
        try:
            train.wait_for(r"run interrupt-stopping started")
            train.proc.send_signal(signal.SIGINT)
            train.wait_for(r"interrupted: stopping run interrupt-stopping")
            time.sleep(1.0)  # StopRun is in flight: the coordinator waits for the run's call to the hung peer
            assert train.proc.poll() is None, train.output
            pid = train.proc.pid
            assert Path(f"/proc/{pid}/task/{pid}/children").read_text().split() == []  # nothing to leave behind
            train.proc.send_signal(signal.SIGINT)
            assert train.exit_code(timeout_s=15) == 130, train.output
            assert "left run interrupt-stopping stopping on the coordinator" in train.output
            assert "Traceback" not in train.output
        finally:
            if train.proc.poll() is None:
                train.proc.kill()
            hung.close()  # the run's call fails now, and the run ends
    wait_until(lambda: phase(address, "interrupt-stopping") in TERMINAL, [], 120, "the run's end")
