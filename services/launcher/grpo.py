"""The GRPO service set of `rlfabric up`, in start order, and the run on it.

Order: Redis -> reward worker(s) -> custom verifiers -> rollout replica -> actor and reference trainers ->
coordinator. Every child registers in Redis with a lease; `LocalStack.wait_ready` shows each one arrive, the
custom verifiers are registered, then the run starts (`StartRun`) and its iterations print as they finish.

While the run goes, a `ChildWatcher` thread polls the children: the first one to die is named (service, pid,
exit code, its log's last lines) and the run fails at once, whatever iteration it is in. The private Redis
is the exception: when it dies it is restarted on the same port with its append-only file, and the run goes
on (the services' Redis clients retry through the restart, their heartbeats re-register them, the journal
is replayed from the file). Every child, Redis included, is guarded by a `Reaper`, so even a SIGKILLed
`rlfabric up` leaves no process or port behind.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc

from services.common.processes import ChildWatcher, Reaper, ServiceStartError, tail
from services.launcher.stack import Expected, LocalStack

logger = logging.getLogger(__name__)


class GrpoStack:
    """One GRPO run's services on this host (see module doc) and the client that drives the run."""

    def __init__(self, stack: LocalStack, config_path: Path, overrides: list[str], cfg: Any, *,
                 reward_workers: int = 1, reward_processes: int = 1, full_metrics: bool = False,
                 trainer_threads: int = 1) -> None:
        self.stack = stack
        self.config_path = Path(config_path).resolve()
        self.overrides = list(overrides)
        self.cfg = cfg
        self.reward_workers = reward_workers
        self.reward_processes = reward_processes
        self.full_metrics = full_metrics
        self.trainer_threads = trainer_threads
        self.coordinator_address: str | None = None
        self.run_id: str | None = None

    def start(self) -> None:
        stack = self.stack
        reaper = Reaper.install()
        url = stack.redis_args()  # a file: the private Redis's URL carries its password
        if stack.redis is not None:
            reaper.add_pid(stack.redis.process.pid)
            _forget_members(stack.redis_url)
        cfg_args = ["--config", str(self.config_path)]
        print(f"starting services (logs in {stack.logs_dir})", file=stack.out, flush=True)
        stack.spawn_reward_workers(self.reward_workers, self.reward_processes)
        stack.spawn_verifiers()
        rollout_overrides = [a for o in self.overrides for a in ("--set", o)]
        stack.spawn("rollout-0", ["rollout", "serve", *cfg_args, *rollout_overrides, "--address", "127.0.0.1:0", *url],
                    Expected("rollout-0 (vLLM)", "rollout"))
        trainer_overrides = [a for o in self.overrides for a in ("--override", o)]
        roles = ["actor", "reference"] if self.cfg.derived.use_kl_loss else ["actor"]
        for role in roles:
            stack.spawn(f"trainer-{role}", ["trainer", "serve", *cfg_args, *trainer_overrides, "--role", role,
                                            "--threads", str(self.trainer_threads), *url],
                        Expected(f"trainer-{role} (Megatron)", "trainer", role))
        stack.spawn("coordinator", ["coordinator", "serve", *url, "--runs-dir", str(stack.run_dir / "runs")],
                    Expected("coordinator", "coordinator"))
        stack.wait_ready()
        self.coordinator_address = stack.endpoints("coordinator")[0]
        print(f"services up; coordinator at {self.coordinator_address}", file=stack.out, flush=True)

    def train(self, run_id: str = "", resume: bool = False) -> int:
        def check_services() -> None:
            for p in self.stack.processes:
                p.check()

        with WatchChildren(self.stack):
            return self._train(run_id, resume, check_services)

    def _train(self, run_id: str, resume: bool, check_services: Any) -> int:
        from rlfabric.v1 import coordinator_pb2
        from services.coordinator.follow import FINISHED_OK, start_and_follow

        assert self.coordinator_address is not None
        request = coordinator_pb2.StartRunRequest(run_id=run_id, config_yaml=self.config_path.read_text(),
                                                  overrides=self.overrides, resume=resume)
        try:
            final = start_and_follow(self.coordinator_address, request,
                                     total=int(self.cfg.actor_config.train_iters or 0) or None,
                                     on_started=lambda rid: setattr(self, "run_id", rid),
                                     after_iteration=check_services, full_metrics=self.full_metrics)
        except grpc.RpcError as e:
            check_services()  # a dead child explains a broken stream better than its status code
            raise ServiceStartError(f"coordinator: {e.code().name}: {e.details()}") from e
        if final.phase == coordinator_pb2.RUN_PHASE_FAILED:
            print(f"coordinator log tail:\n{tail(self.stack.logs_dir / 'coordinator.log')}", flush=True)
            # The coordinator may see a child's death (a broken stream) before the watcher's next poll does:
            # when one is dead, it is the cause to name.
            check_services()
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
            except grpc.RpcError as e:  # stopping is best effort: the children are stopped next anyway
                logger.warning("StopRun failed: %s", e)


def _forget_members(redis_url: str | None) -> None:
    """Drops the registrations a private Redis replayed from its append-only file.

    They are the previous `up`'s services (a crash leaves them with up to a lease to live): nothing but this
    `up` starts services on its private Redis, so none of them is alive, and counting them would make a
    resumed run talk to a dead coordinator.
    """
    from services.common.redis_store import KEY_PREFIX, connect

    client = connect(str(redis_url))
    stale = list(client.scan_iter(match=f"{KEY_PREFIX}:members:*", count=500))
    if stale:
        client.delete(*stale)
        logger.info("dropped %d registrations of an earlier run from the private Redis", len(stale))


class WatchChildren:
    """Watches the stack's children while the body runs; a death raises its `ServiceStartError` in this thread.

    The watcher thread signals the main thread (SIGUSR1), whose handler raises: a blocking gRPC read there
    is interrupted at once, instead of when the coordinator's stream next yields.
    """

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self._previous: Any = None
        self._watcher: ChildWatcher | None = None

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals go to the main thread only; the checks after each iteration still run

        def raise_death(_signum: int, _frame: Any) -> None:
            if self._watcher is not None and self._watcher.error is not None:
                raise self._watcher.error

        main = threading.main_thread().ident
        assert main is not None
        self._previous = signal.signal(signal.SIGUSR1, raise_death)
        self._watcher = ChildWatcher(lambda: self.stack.processes,
                                     lambda _e: signal.pthread_kill(main, signal.SIGUSR1), tick=self._keep_redis)

    def _keep_redis(self) -> None:
        """Restarts the stack's private Redis if it died (same port, same append-only file)."""
        redis = self.stack.redis
        if redis is None or redis.process.poll() is None:
            return
        port = urlparse(redis.url).port  # (the URL itself carries the password)
        print(f"redis (pid {redis.process.pid}) exited with code {redis.process.returncode}; restarting it on "
              f"port {port} with its append-only file", file=self.stack.out, flush=True)
        try:
            redis.restart()
        except RuntimeError as e:
            raise ServiceStartError(f"redis: {e}") from e
        if Reaper.active is not None:
            Reaper.active.add_pid(redis.process.pid)

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            signal.signal(signal.SIGUSR1, self._previous)
