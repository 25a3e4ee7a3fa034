"""`rlfabric coordinator serve` and `rlfabric train`: the coordinator process and its client."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from services.common.net import add_network_arguments, advertised_address, check_network_arguments

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    co = subparsers.add_parser("coordinator", help="the coordinator service (sequences GRPO iterations)")
    co_sub = co.add_subparsers(dest="coordinator_command", metavar="COMMAND", required=True)
    serve = co_sub.add_parser("serve", help="serve the Coordinator gRPC API")
    add_network_arguments(serve, default_address="127.0.0.1:0",
                          redis_help="Redis holding membership and the run journal (default: $REDIS_URL)")
    serve.add_argument("--configs-dir", type=Path, default=REPO_CONFIGS,
                       help="where `defaults: model:` includes resolve (default: the repo's configs/)")
    serve.add_argument("--runs-dir", type=Path, default=Path("runs"), help="per-run metrics and copies (default ./runs)")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (default: a free port)")
    serve.add_argument("--instance-id", default=f"coordinator-{os.getpid()}", help="registry id")
    serve.add_argument("--discovery-timeout", type=float, default=300.0,
                       help="seconds a run waits for its services to register (default 300)")
    from services.common.security import add_security_args

    add_security_args(serve)  # the token guards StartRun/StopRun and goes with every call to the services
    serve.set_defaults(func=_serve)

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


def _serve(args: argparse.Namespace) -> int:
    from rlfabric.v1 import coordinator_pb2_grpc
    from services.common.redis_store import Registry, connect
    from services.common.security import server_security
    from services.common.server import ServiceSpec, create_server, serve_until_signal
    from services.coordinator.app import build_driver, warm_imports
    from services.coordinator.server import SERVICE_NAME, CoordinatorServicer

    try:
        server_security(args, "rlfabric.v1.Coordinator")  # create_server below and the run's calls use this token and TLS
    except ValueError as e:
        print(f"rlfabric coordinator serve: {e}", file=sys.stderr)
        return 2
    if not args.redis_url:
        print("rlfabric coordinator serve: give --redis-url or --redis-url-file", file=sys.stderr)
        return 2
    bad = check_network_arguments(args)
    if bad:
        print(f"rlfabric coordinator serve: {bad}", file=sys.stderr)
        return 2
    client = connect(args.redis_url)
    threading.Thread(target=warm_imports, name="warm-imports", daemon=True).start()

    def factory(config_yaml: str, overrides: list[str], run_id: str):
        return build_driver(config_yaml, overrides, run_id, redis_client=client, configs_dir=args.configs_dir,
                            runs_dir=args.runs_dir, token=args.auth_token, discovery_timeout_s=args.discovery_timeout)

    servicer = CoordinatorServicer(client, factory)
    server = create_server([ServiceSpec(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer, SERVICE_NAME)],
                           args.address, component="coordinator", metrics_port=args.metrics_port).start()
    endpoint = advertised_address(args, server.port)
    with Registry(client).register("coordinator", args.instance_id, endpoint):
        print(f"coordinator serving on {endpoint} (bound {args.address})", flush=True)
        serve_until_signal(server)
    return 0


def _train(args: argparse.Namespace) -> int:
    import grpc

    from rlfabric.v1 import coordinator_pb2
    from services.common.security import configure_client
    from services.coordinator.follow import FINISHED_OK, start_and_follow, stop_after_interrupt

    if args.config is None:
        from services.launcher.system import SystemStateError, system_run_config

        try:
            system_run_config(args)
        except SystemStateError as e:
            print(f"error: no CONFIG given and {e}", file=sys.stderr)
            return 2
    if not args.coordinator:
        from services.launcher.system import SystemStateError, system_client_args

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
