"""The services of one single-host run, started in order and stopped in reverse."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.common.processes import ServiceProcess, ServiceStartError, tail, wait_until
from services.common.redis_store import RedisServer, Registry, connect, start_private_redis

logger = logging.getLogger(__name__)

__all__ = ["LocalStack", "ServiceStartError"]


class LocalStack:
    def __init__(self, config_path: Path, overrides: list[str], cfg: Any, run_dir: Path, *,
                 redis_url: str | None = None, reward_workers: int = 1, reward_processes: int = 1,
                 startup_timeout_s: float = 600.0) -> None:
        self.config_path = Path(config_path).resolve()
        self.overrides = list(overrides)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.redis_url = redis_url
        self.reward_workers = reward_workers
        self.reward_processes = reward_processes
        self.startup_timeout_s = startup_timeout_s
        self.redis: RedisServer | None = None
        self.processes: list[ServiceProcess] = []
        self.coordinator_address: str | None = None
        self.run_id: str | None = None

    def _spawn(self, name: str, args: list[str]) -> ServiceProcess:
        proc = ServiceProcess(name, args, self.run_dir / "logs" / f"{name}.log").start()
        self.processes.append(proc)
        return proc

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.redis_url is None:
            self.redis = start_private_redis(str(self.run_dir / "redis"), appendonly=True)
            self.redis_url = self.redis.url
        registry = Registry(connect(self.redis_url))
        url = ["--redis-url", self.redis_url]
        cfg_args = ["--config", str(self.config_path)]
        for i in range(self.reward_workers):
            self._spawn(f"reward-{i}", ["reward", "serve", *url, "--processes", str(self.reward_processes)])
        rollout_overrides = [a for o in self.overrides for a in ("--set", o)]
        self._spawn("rollout-0", ["rollout", "serve", *cfg_args, *rollout_overrides, "--address", "127.0.0.1:0", *url])
        trainer_overrides = [a for o in self.overrides for a in ("--override", o)]
        self._spawn("trainer-actor", ["trainer", "serve", *cfg_args, *trainer_overrides, "--role", "actor", *url])
        if self.cfg.derived.use_kl_loss:
            self._spawn("trainer-reference", ["trainer", "serve", *cfg_args, *trainer_overrides, "--role", "reference",
                                              *url])
        self._spawn("coordinator", ["coordinator", "serve", *url, "--runs-dir", str(self.run_dir / "runs")])

        def coordinator_up() -> bool:
            members = registry.members("coordinator")
            if members:
                self.coordinator_address = members[0].endpoint
            return bool(members)

        wait_until(coordinator_up, self.processes, self.startup_timeout_s, "the coordinator")
        print(f"services up (logs in {self.run_dir / 'logs'}); coordinator at {self.coordinator_address}", flush=True)

    def train(self, run_id: str = "", resume: bool = False) -> int:
        import grpc

        from rlfabric.v1 import coordinator_pb2
        from services.coordinator.follow import FINISHED_OK, start_and_follow

        assert self.coordinator_address is not None

        def check_services() -> None:
            for p in self.processes:
                p.check()

        request = coordinator_pb2.StartRunRequest(run_id=run_id, config_yaml=self.config_path.read_text(),
                                                  overrides=self.overrides, resume=resume)
        try:
            final = start_and_follow(self.coordinator_address, request,
                                     total=int(self.cfg.actor_config.train_iters or 0) or None,
                                     on_started=lambda rid: setattr(self, "run_id", rid),
                                     after_iteration=check_services)
        except grpc.RpcError as e:
            raise ServiceStartError(f"coordinator: {e.code().name}: {e.details()}") from e
        if final.phase == coordinator_pb2.RUN_PHASE_FAILED:
            print(f"coordinator log tail:\n{tail(self.run_dir / 'logs' / 'coordinator.log')}", flush=True)
        return 0 if final.phase in FINISHED_OK else 1

    def stop_run(self) -> None:
        if not (self.coordinator_address and self.run_id):
            return
        from rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
        from services.common.client import make_channel

        with make_channel(self.coordinator_address) as channel:
            try:
                coordinator_pb2_grpc.CoordinatorStub(channel).StopRun(
                    coordinator_pb2.StopRunRequest(run_id=self.run_id), timeout=300)
            except Exception as e:  # stopping is best effort: the children are stopped next anyway
                logger.warning("StopRun failed: %s", e)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        if self.redis is not None:
            self.redis.stop()
