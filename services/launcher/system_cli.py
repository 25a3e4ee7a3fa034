"""The commands of `rlfabric system` (see services/launcher/system.py); `make up|ps|logs|scale-reward|down` run them.

    rlfabric system up CONFIG [-o K=V ...] [--reward-workers N] [--rollout-replicas N] [--dir runs/system]
    rlfabric system ps | logs [SERVICE] | down            [--dir runs/system]
    rlfabric system scale reward|rollout N                [--dir runs/system]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from services.common.service_kind import ServiceKind
from services.launcher.cli import add_service_arguments, service_count_error

DEFAULT_DIR = Path("runs/system")


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("system", help="the services of one host as a detached system: up, ps, logs, scale, "
                                             "down", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="system_command", metavar="COMMAND", required=True)
    up = sub.add_parser("up", help="start Redis and every service detached; return once all report SERVING",
                        description="The -o overrides reach the services; give `rlfabric train` the same ones.")
    up.add_argument("config", type=Path, help="MindSpeed-RL GRPO YAML (rollout and trainers are built from it)")
    add_service_arguments(up)
    ps = sub.add_parser("ps", help="service, instance, pid, address, health and weights version of each process")
    logs = sub.add_parser("logs", help="the last lines of every log, or of SERVICE's")
    logs.add_argument("service", nargs="?", default="", help="a service (reward, rollout, trainer, coordinator, "
                                                             "redis) or an instance (reward-1)")
    logs.add_argument("-n", "--lines", type=int, default=20, help="lines per log (default 20)")
    scale = sub.add_parser("scale", help="start or drain reward workers / rollout replicas on a running system")
    scale.add_argument("service", choices=(ServiceKind.REWARD, ServiceKind.ROLLOUT))
    scale.add_argument("count", type=int, help="how many there should be")
    scale.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds a removed one may take to finish what it holds (default 60)")
    down = sub.add_parser("down", help="stop every process of the system; check no process or port remains")
    down.add_argument("--grace", type=float, default=30.0, help="seconds each gets after SIGTERM (default 30)")
    for command, func in ((up, _up), (ps, _ps), (logs, _logs), (scale, _scale), (down, _down)):
        command.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                             help=f"the system's directory: state, logs, Redis, runs (default {DEFAULT_DIR})")
        command.set_defaults(func=func)


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _up(args: argparse.Namespace) -> int:
    from services.common.config import ConfigError, check_run_files, load_config
    from services.launcher.system import SystemStateError, locked, state_path

    count_error = service_count_error(args)
    if count_error is not None:
        return _fail(count_error, 2)
    try:
        cfg = load_config(args.config, args.override)
        check_run_files(cfg)  # every missing file and model-block mismatch named before anything starts
    except ConfigError as e:
        return _fail(f"config: {e}", 2)
    try:
        with locked(args.dir):
            if state_path(args.dir).exists():
                return _fail(f"a system already runs from {args.dir} ({state_path(args.dir)}): `make down` first")
            return _start(args, cfg)
    except SystemStateError as e:
        return _fail(str(e))


def _start(args: argparse.Namespace, cfg) -> int:
    from services.launcher.stack import Expected, ServiceStartError
    from services.launcher.system import SystemStack, as_dicts, wait_serving, write_state
    from services.launcher.tools import wait_sandboxes

    stack = SystemStack(args.dir.resolve(), startup_timeout_s=args.startup_timeout)
    config = str(args.config.resolve())
    try:
        stack.start_redis()
        redis = stack.redis_args()
        print(f"starting services (logs in {stack.logs_dir})", flush=True)
        for i in range(args.reward_workers):
            stack.spawn_reward(f"reward-{i}", args.reward_processes)
        tools = _spawn_tools(stack, cfg, redis, args.tool_servers)
        for i in range(args.rollout_replicas):
            stack.spawn_rollout(f"rollout-{i}", config, args.override)
        for role in cfg.derived.trainer_roles:
            stack.spawn(f"trainer-{role}", ["trainer", "serve", "--config", config,
                                            *[a for o in args.override for a in ("--override", o)], "--role", role,
                                            "--threads", str(args.trainer_threads),
                                            *redis, "--instance-id", f"trainer-{role}"],
                        Expected(f"trainer-{role} (Megatron)", ServiceKind.TRAINER, role))
        stack.spawn("coordinator", ["coordinator", "serve", *redis, "--runs-dir",
                                    str(stack.run_dir / "runs"), "--instance-id", "coordinator"],
                    Expected("coordinator", ServiceKind.COORDINATOR))
        stack.wait_ready()
        if tools is not None:
            wait_sandboxes(*tools, timeout_s=max(10.0, args.startup_timeout), say=stack._say)
        items = stack.entries()
        wait_serving(items, timeout_s=60)
    except ServiceStartError as e:
        stack.stop()
        shutil.rmtree(stack.secrets_dir, ignore_errors=True)
        started = [f"{p.name} pid {p.proc.pid}" for p in stack.processes if p.proc is not None]
        if stack.redis is not None:
            started.insert(0, f"redis pid {stack.redis.process.pid}")
        return _fail(f"{e}\n(every service started was stopped again: {', '.join(started)})")
    write_state(stack.run_dir, {"config": config, "overrides": args.override,
                                "redis_url_file": str(stack.redis_url_file), "token_file": str(stack.token_file),
                                "reward_processes": args.reward_processes, "started": time.time(),
                                "services": as_dicts(items)})
    _print_summary(stack.run_dir, items, cfg)
    return 0


def _spawn_tools(stack, cfg, redis: list[str], count: int):
    """With multi_turn_enable: the sandboxes and `count` tool servers (services/launcher/tools.py), else None."""
    from services.launcher.stack import Expected
    from services.launcher.tools import plan_tools, start_sandboxes, tool_server_args

    plan = plan_tools(cfg, stack.run_dir)
    if plan is None:
        return None
    sandboxes = start_sandboxes(plan, stack.logs_dir, detached=True)
    stack.processes.extend(sandboxes)
    stack.addresses.update({p.name: f"127.0.0.1:{s.port}" for p, s in zip(sandboxes, plan.sandboxes, strict=True)})
    for i in range(count):
        name = f"{ServiceKind.TOOLS}-{i}"
        stack.spawn(name, [*tool_server_args(plan, redis), "--instance-id", name], Expected(name, ServiceKind.TOOLS))
    return plan, sandboxes


def _print_summary(root: Path, items, cfg) -> None:
    coordinator = next(e.address for e in items if e.service == ServiceKind.COORDINATOR)
    print(f"system up ({len(items)} processes; `make ps`, `make logs SERVICE=...`, `make down`)")
    print(f"  coordinator   {coordinator}   run: make train [ARGS='-o ...'] (rlfabric train [CONFIG] [-o ...] "
          f"--system-dir {root}, or --coordinator {coordinator} --auth-token-file {root / 'secrets' / 'token'})")
    print(f"  logs          {root / 'logs'}/<instance>.log  (Redis: {root / 'redis' / 'redis.log'})")
    print(f"  metrics       {root / 'runs'}/<run id>/metrics.jsonl")
    tb = getattr(cfg.actor_config, "tensorboard_dir", None) or f"{root / 'runs'}/<run id>/tensorboard"
    print(f"  tensorboard   {tb}" + ("" if cfg.rl_config.use_tensorboard else "  (rl_config.use_tensorboard is off)"))
    ports = ", ".join(f"{e.instance} :{e.metrics_port}" for e in items if e.metrics_port)
    print(f"  prometheus    {ports}")


def _ps(args: argparse.Namespace) -> int:
    from services.launcher.system import (
        SystemStateError,
        configure_client_from,
        entries,
        entry_health,
        pid_alive,
        read_state,
        weights_version,
    )

    try:
        state = read_state(args.dir)
        configure_client_from(state)  # Info calls carry the system's token
    except SystemStateError as e:
        return _fail(str(e))
    rows = [("SERVICE", "INSTANCE", "PID", "ADDRESS", "HEALTH", "WEIGHTS")]
    for e in entries(state):
        alive = pid_alive(e.pid)
        status = entry_health(e) if alive else "EXITED"
        rows.append((e.service, e.instance, str(e.pid), e.address or "-", status,
                     weights_version(e) if alive else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _logs(args: argparse.Namespace) -> int:
    from services.common.processes import tail
    from services.launcher.system import SystemStateError, entries, read_state

    try:
        items = entries(read_state(args.dir))
    except SystemStateError as e:
        return _fail(str(e))
    chosen = [e for e in items if not args.service or args.service in (e.service, e.instance)]
    if not chosen:
        return _fail(f"no service or instance {args.service!r}; there are: {', '.join(e.instance for e in items)}", 2)
    for e in chosen:
        print(f"==> {e.instance} ({e.log}) <==")
        print(tail(Path(e.log), args.lines))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from services.launcher.system import SystemStateError, locked
    from services.launcher.system_scale import scale

    least = 0 if args.service == ServiceKind.REWARD else 1
    if args.count < least:
        return _fail(f"{args.service} count must be at least {least}", 2)
    try:
        with locked(args.dir):
            return scale(args.dir.resolve(), args.service, args.count, drain_s=args.drain_timeout)
    except SystemStateError as e:
        return _fail(str(e))


def _down(args: argparse.Namespace) -> int:
    from services.launcher.system import SystemStateError, locked
    from services.launcher.system_scale import down

    try:
        with locked(args.dir, wait_s=600):  # a `scale` that runs finishes first, so what it starts is stopped too
            code = down(args.dir, grace_s=args.grace)
    except SystemStateError as e:
        return _fail(str(e))
    return code
