"""`rlfabric coordinator serve`: the coordinator process.

Its client, `rlfabric train`, is services/launcher/train_cli.py (it reads the state of `rlfabric system`).
"""

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


def _serve(args: argparse.Namespace) -> int:
    from rlfabric.v1 import coordinator_pb2_grpc
    from services.common.redis_store import Registry, connect
    from services.common.security import server_security
    from services.common.server import ServiceSpec, create_server, serve_until_signal
    from services.common.service_kind import ServiceKind
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
    # Not a daemon: a coordinator stopped during its first seconds waits for the import to end rather than
    # finalizing the interpreter under a thread that holds import locks.
    threading.Thread(target=warm_imports, name="warm-imports").start()

    def factory(config_yaml: str, overrides: list[str], run_id: str):
        return build_driver(config_yaml, overrides, run_id, redis_client=client, configs_dir=args.configs_dir,
                            runs_dir=args.runs_dir, token=args.auth_token, discovery_timeout_s=args.discovery_timeout)

    servicer = CoordinatorServicer(client, factory)
    server = create_server([ServiceSpec(coordinator_pb2_grpc.add_CoordinatorServicer_to_server, servicer, SERVICE_NAME)],
                           args.address, component="coordinator", metrics_port=args.metrics_port).start()
    endpoint = advertised_address(args, server.port)
    with Registry(client).register(ServiceKind.COORDINATOR, args.instance_id, endpoint):
        print(f"coordinator serving on {endpoint} (bound {args.address})", flush=True)
        serve_until_signal(server)
    return 0
