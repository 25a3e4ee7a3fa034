"""The GRPO service set of `rlfabric up`, in start order, and the run on it.

Order: Redis -> reward worker(s) -> custom verifiers -> (multi-turn runs: code sandbox, tool servers) ->
rollout replica -> actor and reference trainers -> coordinator. Every child registers in Redis with a lease (a
sandbox answers `/health` instead); `LocalStack.wait_ready` shows each one arrive, the custom verifiers are
registered, then the run starts (`StartRun`) and its iterations print as they finish. The tool side is
services/launcher/tools.py's.

With `reward_workers` or `rollout_replicas` above 1 those services are redundant: while the run goes, a
`Supervisor` (services/launcher/supervision.py) lets one of them die (naming it and what took over, and
restarting it), and fails the run at once on any other death, naming the child (service, pid, exit code, its
log's last lines). Every child, Redis included, is guarded by a `Reaper`, so even a SIGKILLed `rlfabric up`
leaves no process or port behind. Ctrl-C stops the run after its current phase and says at which iteration
it stopped and how to resume it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc

from services.common.processes import Reaper, ServiceProcess, ServiceStartError, tail
from services.common.service_kind import ServiceKind
from services.launcher.stack import Expected, LocalStack
from services.launcher.supervision import Supervisor
from services.launcher.tools import (
    ToolPlan,
    plan_tools,
    start_sandboxes,
    tool_server_args,
    wait_sandboxes,
)

logger = logging.getLogger(__name__)


class GrpoStack:
    """One GRPO run's services on this host (see module doc) and the client that drives the run."""

    def __init__(self, stack: LocalStack, config_path: Path, overrides: list[str], cfg: Any, *,
                 reward_workers: int = 1, reward_processes: int = 1, full_metrics: bool = False,
                 trainer_threads: int = 1, rollout_replicas: int = 1, tool_servers: int = 1) -> None:
        self.stack = stack
        self.config_path = Path(config_path).resolve()
        self.overrides = list(overrides)
        self.cfg = cfg
        self.reward_workers = reward_workers
        self.reward_processes = reward_processes
        self.full_metrics = full_metrics
        self.trainer_threads = trainer_threads
        self.rollout_replicas = rollout_replicas
        self.tool_servers = tool_servers
        self.coordinator_address: str | None = None
        self.run_id: str | None = None
        self.last_logged = 0  # the last iteration the console printed
        self.supervisor = Supervisor(stack)

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
        tools = self._spawn_tools(url)
        rollout_overrides = [a for o in self.overrides for a in ("--set", o)]
        for i in range(self.rollout_replicas):
            stack.spawn(f"rollout-{i}", ["rollout", "serve", *cfg_args, *rollout_overrides, "--address", "127.0.0.1:0",
                                         *url], Expected(f"rollout-{i} (vLLM)", ServiceKind.ROLLOUT))
        trainer_overrides = [a for o in self.overrides for a in ("--override", o)]
        for role in self.cfg.derived.trainer_roles:
            stack.spawn(f"trainer-{role}", ["trainer", "serve", *cfg_args, *trainer_overrides, "--role", role,
                                            "--threads", str(self.trainer_threads), *url],
                        Expected(f"trainer-{role} (Megatron)", ServiceKind.TRAINER, role))
        stack.spawn("coordinator", ["coordinator", "serve", *url, "--runs-dir", str(stack.run_dir / "runs")],
                    Expected("coordinator", ServiceKind.COORDINATOR))
        stack.wait_ready()
        if tools is not None:
            plan, sandboxes = tools
            wait_sandboxes(plan, sandboxes, max(10.0, stack.startup_timeout_s), say=stack._say)
        self.coordinator_address = stack.endpoints(ServiceKind.COORDINATOR)[0]
        print(f"services up; coordinator at {self.coordinator_address}", file=stack.out, flush=True)

    def _spawn_tools(self, redis_args: list[str]) -> tuple[ToolPlan, list[ServiceProcess]] | None:
        """With multi_turn_enable: the sandboxes the tool YAML needs and the tool servers (see tools.py)."""
        plan = plan_tools(self.cfg, self.stack.run_dir)
        if plan is None:
            return None
        sandboxes = start_sandboxes(plan, self.stack.logs_dir, detached=self.stack.detached)
        self.stack.processes.extend(sandboxes)
        for i in range(self.tool_servers):
            self.stack.spawn(f"{ServiceKind.TOOLS}-{i}", tool_server_args(plan, redis_args),
                             Expected(f"{ServiceKind.TOOLS}-{i}", ServiceKind.TOOLS))
        return plan, sandboxes

    def train(self, run_id: str = "", resume: bool = False) -> int:
        with self.supervisor:
            return self._train(run_id, resume)

    def _logged(self, iteration: int) -> None:
        self.last_logged = iteration

    def _train(self, run_id: str, resume: bool) -> int:
        from rlfabric.v1 import coordinator_pb2
        from services.coordinator.follow import FINISHED_OK, start_and_follow

        assert self.coordinator_address is not None
        request = coordinator_pb2.StartRunRequest(run_id=run_id, config_yaml=self.config_path.read_text(),
                                                  overrides=self.overrides, resume=resume)
        try:
            final = start_and_follow(self.coordinator_address, request,
                                     total=int(self.cfg.actor_config.train_iters or 0) or None,
                                     on_started=lambda rid: setattr(self, "run_id", rid),
                                     after_iteration=lambda _: self.supervisor.check(),
                                     on_iteration=self._logged, full_metrics=self.full_metrics)
        except grpc.RpcError as e:
            self.supervisor.settle()  # a dead child explains a broken stream better than its status code
            raise ServiceStartError(f"coordinator: {e.code().name}: {e.details()}") from e
        if final.phase == coordinator_pb2.RUN_PHASE_FAILED:
            print(f"coordinator log tail:\n{tail(self.stack.logs_dir / 'coordinator.log')}", flush=True)
            # The coordinator may see a child's death (a broken stream) before the watcher's next poll does:
            # when one is dead, it is the cause to name.
            self.supervisor.settle()
        return 0 if final.phase in FINISHED_OK else 1

    def stop_run(self) -> None:
        """After Ctrl-C: StopRun, then where the run stopped (see `stop_after_interrupt`)."""
        if not (self.coordinator_address and self.run_id):
            return
        from services.coordinator.follow import stop_after_interrupt

        stop_after_interrupt(self.coordinator_address, self.run_id, last_logged=self.last_logged)


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
