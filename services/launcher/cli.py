"""`rlfabric up`: one GRPO run on one host, every service a child process, Redis private unless given.

Order: Redis -> reward worker(s) -> rollout replica -> actor and reference trainers -> coordinator; each
registers in Redis with a lease, and the run starts once the coordinator has found them all. Ctrl-C
stops the run (journaled, resumable with `--resume --run-id ID`) and then every child.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run GRPO on this host: start Redis and every service, train, stop",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="MindSpeed-RL GRPO YAML")
    p.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="dotted config override, repeatable")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="use this Redis instead of starting a private one (default: $REDIS_URL)")
    p.add_argument("--run-dir", type=Path, default=None, help="logs and metrics (default: runs/up-TIMESTAMP)")
    p.add_argument("--run-id", default="", help="run id (default: generated)")
    p.add_argument("--resume", action="store_true", help="continue --run-id from its journal (needs --redis-url "
                   "or the same --run-dir, whose Redis keeps an append-only file)")
    p.add_argument("--reward-workers", type=int, default=1, help="reward worker processes (default 1)")
    p.add_argument("--reward-processes", type=int, default=1, help="verifier pool processes per worker (default 1)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for services (default 600)")
    p.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from services.common.config import ConfigError, check_model_files, load_config

    try:
        cfg = load_config(args.config, args.override)
        check_model_files(cfg)  # the model block against the config.json the services load, before any starts
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    from services.launcher.stack import LocalStack, ServiceStartError

    run_dir = args.run_dir or Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    stack = LocalStack(args.config, args.override, cfg, run_dir, redis_url=args.redis_url,
                       reward_workers=args.reward_workers, reward_processes=args.reward_processes,
                       startup_timeout_s=args.startup_timeout)
    try:
        stack.start()
        return stack.train(run_id=args.run_id, resume=args.resume)
    except ServiceStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopping the run and the services", file=sys.stderr)
        stack.stop_run()
        return 130
    finally:
        stack.stop()
