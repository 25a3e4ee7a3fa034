"""`rlfabric train`: start a GRPO run on a coordinator and stream its metrics until it ends.

Without CONFIG or --coordinator it reads them from the system `rlfabric system up` (make up) started in
--system-dir, which is why it sits with the launcher, above the coordinator whose client it is
(services/coordinator/follow.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.security import add_security_args


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    tr = subparsers.add_parser("train", help="start a GRPO run on a coordinator and stream its metrics")
    tr.add_argument("config", type=Path, nargs="?", default=None,
                    help="MindSpeed-RL GRPO YAML (default: the config and overrides `rlfabric system up` started "
                         "the system in --system-dir with; -o then adds to those overrides)")
    tr.add_argument("-o", "--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="dotted override, repeatable")
    tr.add_argument("--coordinator", default=None,
                    help="coordinator address host:port (default: the one `rlfabric system up` started in --system-dir)")
    tr.add_argument("--system-dir", type=Path, default=Path("runs/system"),
                    help="where `rlfabric system up` (make up) keeps its state (default runs/system); without "
                         "--coordinator, the address and the service token (--auth-token-file) come from there")
    tr.add_argument("--run-id", default="", help="run id (default: generated)")
    tr.add_argument("--resume", action="store_true", help="continue the run from its journal and last checkpoint")
    add_security_args(tr, server=False, redis=False)
    tr.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import grpc

    from rlfabric.v1 import coordinator_pb2
    from services.common.security import configure_client
    from services.coordinator.follow import FINISHED_OK, start_and_follow, stop_after_interrupt
    from services.launcher.system import SystemStateError, system_client_args, system_run_config

    if args.config is None:
        try:
            system_run_config(args)
        except SystemStateError as e:
            print(f"error: no CONFIG given and {e}", file=sys.stderr)
            return 2
    if not args.coordinator:
        try:
            system_client_args(args)
        except SystemStateError as e:
            print(f"error: no --coordinator given and {e}", file=sys.stderr)
            return 2
    try:
        configure_client(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        text = args.config.read_text()
    except OSError as e:
        print(f"error: cannot read {args.config}: {e}", file=sys.stderr)
        return 2
    request = coordinator_pb2.StartRunRequest(run_id=args.run_id, config_yaml=text, overrides=args.override,
                                              resume=args.resume)
    started: list[str] = []
    try:
        final = start_and_follow(args.coordinator, request, on_started=started.append)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:
        run_id = started[0] if started else args.run_id
        if run_id:
            stop_after_interrupt(args.coordinator, run_id)
        return INTERRUPTED
    return 0 if final.phase in FINISHED_OK else 1


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd command
