"""Fixtures of the fault tests: the run's settings for the tiny model, a reward worker, rollout replicas as
separate processes (`rlfabric rollout serve`, registered in the session's Redis) that a test may SIGKILL."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.processes import ServiceProcess, wait_until
from services.common.redis_store import Registry, connect


@pytest.fixture(scope="session")
def tiny_settings(tiny_model_dir: Path, repo_root: Path):
    """IterationSettings of configs/grpo_tiny_cpu.yaml with 4 samples of up to 48 tokens per prompt."""
    from services.common.config import load_config
    from services.coordinator.settings import settings_from_config

    cfg = load_config(repo_root / "configs" / "grpo_tiny_cpu.yaml",
                      [f"megatron_training.tokenizer_name_or_path={tiny_model_dir}"])
    return dataclasses.replace(settings_from_config(cfg), n_samples_per_prompt=4, max_tokens=48, temperature=1.0,
                               top_p=1.0, top_k=-1, min_p=0.0, seed=None, deadline_s=300.0)


@pytest.fixture(scope="module")
def reward_score(redis_url: str) -> Iterator:
    """The coordinator's reward stream (RewardClientPool.score) over one in-process worker of its own."""
    from services.coordinator.reward_pool import RewardClientPool
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    options = RewardWorkerOptions(processes=1, redis_url=redis_url, worker_id="reliability-reward", metrics_port=None)
    with RewardWorker(options):
        registry = Registry(connect(redis_url))
        wait_until(lambda: any(m.instance_id == "reliability-reward" for m in registry.members("reward")), [], 60,
                   "reward worker registration")
        yield RewardClientPool(registry).score


class Replicas:
    """Starts `rlfabric rollout serve` replicas under given instance ids; `address(id)` once registered."""

    def __init__(self, repo_root: Path, redis_url: str, model: Path, log_dir: Path) -> None:
        self.repo_root, self.redis_url, self.model, self.log_dir = repo_root, redis_url, model, log_dir
        self.registry = Registry(connect(redis_url))
        self.started: dict[str, ServiceProcess] = {}

    def start(self, instance_id: str) -> ServiceProcess:
        proc = ServiceProcess(instance_id, [
            "rollout", "serve", "--model", str(self.model), "--address", "127.0.0.1:0", "--dtype", "float32",
            "--tensor-parallel-size", "1", "--max-model-len", "256", "--max-num-seqs", "16", "--num-threads", "1",
            "--redis-url", self.redis_url,
            "--instance-id", instance_id, "--insecure"],  # the tests' trainer pushes without a token
            self.log_dir / f"{instance_id}.log", env={"PYTHONPATH": str(self.repo_root)}).start()
        self.started[instance_id] = proc
        return proc

    def address(self, instance_id: str, timeout_s: float = 300) -> str:
        def registered() -> bool:
            return any(m.instance_id == instance_id for m in self.registry.members("rollout"))

        wait_until(registered, [self.started[instance_id]], timeout_s, f"rollout replica {instance_id}")
        return next(m.endpoint for m in self.registry.members("rollout") if m.instance_id == instance_id)

    def signal(self, instance_id: str, sig: signal.Signals) -> None:
        """SIGKILL (waited for) or SIGSTOP (the process stays, silent, until the fixture ends it)."""
        proc = self.started[instance_id].proc
        assert proc is not None
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.started.values():
            proc.stop()


@pytest.fixture
def replicas(repo_root: Path, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(repo_root, redis_url, tiny_model_dir, tmp_path)
    yield started
    started.stop_all()
    deadline = time.monotonic() + 15  # a killed one's registration expires with its lease
    while started.registry.members("rollout") and time.monotonic() < deadline:
        time.sleep(0.2)
