"""`rlfabric up`: one GRPO run on one host, every service a child process, Redis private unless given.

Order: Redis -> reward worker(s) -> custom verifiers -> rollout replica -> actor and reference trainers ->
coordinator; each registers in Redis with a lease, and the run starts once all have. Ctrl-C stops the run
(journaled, resumable with `--resume --run-id ID`) and then every child.

With rl_config.multi_turn_enable, the tool servers (`rlfabric tools serve`, --tool-servers of them) and, for a
local sandbox_fusion_url in the tool YAML, a code sandbox (`rlfabric sandbox serve`) start too; see
services/launcher/tools.py.

The children are supervised (services/launcher/supervision.py): with 2 or more reward workers or rollout
replicas one may die, the others take its samples or prompts and it is restarted; a tool server or sandbox
that dies is restarted, the calls it would answer meanwhile being tool errors.

Custom verifiers (servers of rlfabric.v1.Verifier) join the run with
  --verifier NAME=HOST:PORT                       a server that already runs, or
  --verifier-command 'NAME=python my.py --port {port}'   started on a free port and stopped with the run;
either way they are registered with the run's reward workers before the first iteration, and the YAML names
them in rl_config.verifier_function like a built-in rule.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from services.common.net import env_redis_url


def add_verifier_arguments(p: argparse.ArgumentParser) -> None:
    """The custom-verifier flags `rlfabric up` and `rlfabric eval` share."""
    p.add_argument("--verifier", action="append", default=[], metavar="NAME=HOST:PORT",
                   help="register a running rlfabric.v1.Verifier server under NAME (repeatable)")
    p.add_argument("--verifier-command", action="append", default=[], metavar="'NAME=COMMAND'",
                   help="start COMMAND (which must contain {port}, replaced by a free port) and register it under "
                        "NAME; it stops with the run (repeatable)")


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `rlfabric up` and `rlfabric system up` share: config overrides, how many of each service to
    start (checked by `service_count_error`), and how long they may take to register."""
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="dotted config override, repeatable")
    p.add_argument("--reward-workers", type=int, default=1, help="reward worker processes (default 1)")
    p.add_argument("--reward-processes", type=int, default=1, help="verifier pool processes per worker (default 1)")
    p.add_argument("--rollout-replicas", type=int, default=1, help="rollout replicas, each a vLLM engine (default 1)")
    p.add_argument("--tool-servers", type=int, default=1,
                   help="tool servers of a multi-turn config (rl_config.multi_turn_enable; default 1)")
    p.add_argument("--trainer-threads", type=int, default=1, metavar="N",
                   help="torch threads of each trainer rank (default 1; 2 on a 2-core host makes a synchronous run's "
                        "update, which runs alone, faster)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for services (default 600)")


# The count flags of `add_service_arguments`: none may be under 1.
_COUNT_FLAGS = ("--reward-workers", "--reward-processes", "--rollout-replicas", "--tool-servers", "--trainer-threads")


def service_count_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the first count flag under 1, or None."""
    for flag in _COUNT_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    return None


def verifiers_from_args(args: argparse.Namespace) -> list:
    """CustomVerifiers of the flags; ValueError naming the bad flag."""
    from services.launcher.verifiers import parse_command, parse_endpoint

    found = [parse_endpoint(v) for v in args.verifier] + [parse_command(v) for v in args.verifier_command]
    names = [v.name for v in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"verifier {duplicates[0]!r} is given more than once")
    return found


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run GRPO on this host: start Redis and every service, train, stop",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="MindSpeed-RL GRPO YAML")
    add_service_arguments(p)
    p.add_argument("--redis-url", default=env_redis_url(),
                   help="use this Redis instead of starting a private one (default: $REDIS_URL)")
    p.add_argument("--run-dir", type=Path, default=None, help="logs and metrics (default: runs/up-TIMESTAMP)")
    p.add_argument("--run-id", default="", help="run id (default: generated)")
    p.add_argument("--resume", action="store_true", help="continue --run-id from its journal (needs --redis-url "
                   "or the same --run-dir, whose Redis keeps an append-only file)")
    p.add_argument("--full-metrics", action="store_true",
                   help="print every metric of each iteration (default: a short line; all of them are in "
                        "RUN_DIR/runs/RUN_ID/metrics.jsonl)")
    add_verifier_arguments(p)
    from services.common.security import add_security_args

    add_security_args(p)  # default: a fresh token, a Redis password; TLS with --tls or these PEMs
    p.add_argument("--tls", action="store_true",
                   help="serve every service over TLS with a certificate from a CA made for this run "
                        "(RUN_DIR/secrets; or give --tls-cert/--tls-key/--tls-ca)")
    p.set_defaults(func=_up)


def _tls_choice(args: argparse.Namespace):
    """None, "generate" (--tls) or the (cert, key, ca) of the flags; ValueError naming what is missing."""
    given = (args.tls_cert, args.tls_key, args.tls_ca)
    if args.tls and any(given):
        raise ValueError("--tls makes its own certificates: give it or --tls-cert/--tls-key/--tls-ca, not both")
    if args.tls:
        return "generate"
    if any(given) and not all(given):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together (every service serves the certificate "
                         "and trusts the CA)")
    for flag, path in zip(("--tls-cert", "--tls-key", "--tls-ca"), given, strict=True):
        if path and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    return given if all(given) else None


def _up(args: argparse.Namespace) -> int:
    from services.common.config import ConfigError, check_run_files, load_config
    from services.common.security import resolve_secrets

    count_error = service_count_error(args)
    if count_error is not None:
        print(f"error: {count_error}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.override)
        check_run_files(cfg)  # every missing file and model-block mismatch named before anything starts
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        verifiers = verifiers_from_args(args)
        tls = _tls_choice(args)
        resolve_secrets(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from services.launcher.grpo import GrpoStack
    from services.launcher.stack import LocalStack, ServiceStartError

    run_dir = args.run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    stack = LocalStack(run_dir, redis_url=args.redis_url, startup_timeout_s=args.startup_timeout, verifiers=verifiers,
                       auth_token=args.auth_token, tls=tls)
    grpo = GrpoStack(stack, args.config, args.override, cfg, reward_workers=args.reward_workers,
                     reward_processes=args.reward_processes, full_metrics=args.full_metrics,
                     trainer_threads=args.trainer_threads, rollout_replicas=args.rollout_replicas,
                     tool_servers=args.tool_servers)
    try:
        grpo.start()
        return grpo.train(run_id=args.run_id, resume=args.resume)
    except ServiceStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if grpo.run_id:
            grpo.stop_run()
            again = ["rlfabric", "up", str(args.config), "--resume", "--run-id", grpo.run_id, "--run-dir", str(run_dir),
                     *[a for o in args.override for a in ("-o", o)]]
            print(f"resume it with: {shlex.join(again)}", file=sys.stderr)
        print("interrupted: stopping the services", file=sys.stderr, flush=True)
        return 130
    finally:
        stack.stop()
