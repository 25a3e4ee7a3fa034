"""`rlfabric reward ...`: serve a worker, score a JSONL offline, manage remote verifiers.

    rlfabric reward serve --redis-url redis://127.0.0.1:6379 --processes 2 --auth-token-file TOKEN_FILE
    rlfabric reward score --verifier math_equiv IN.jsonl --out OUT.jsonl
    rlfabric reward score --verifier my_rule --redis-url redis://127.0.0.1:6379 IN.jsonl --out OUT.jsonl
    rlfabric reward register --worker HOST:PORT --auth-token-file TOKEN_FILE --name my_rule --endpoint HOST:PORT
    rlfabric reward list --worker HOST:PORT
    rlfabric reward unregister --worker HOST:PORT --auth-token-file TOKEN_FILE --name my_rule
Heavy imports happen inside the commands, so `rlfabric --help` stays fast.
"""

import argparse
import os
import sys

from services.common.net import add_network_arguments, check_network_arguments, env_redis_url


def _plugin(value: str) -> tuple[str, str]:
    name, sep, spec = value.partition("=")
    if not sep or not name or not spec:
        raise argparse.ArgumentTypeError(f"--verifier-plugin {value!r}: expected NAME=package.module:function "
                                         "or NAME=/path/file.py:function")
    return name, spec


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    reward = subparsers.add_parser("reward", help="reward workers: rule verifiers and custom verifiers")
    commands = reward.add_subparsers(dest="reward_command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="run one reward worker (register it in Redis)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)

    score = commands.add_parser("score", help="score a JSONL of {response, ground_truth} records offline")
    score.add_argument("input", metavar="IN.jsonl", help="records with 'response' and 'ground_truth'")
    score.add_argument("--out", required=True, metavar="OUT.jsonl", help="where to write the scored records")
    score.add_argument("--verifier", required=True,
                       help="a built-in rule, a --verifier-plugin name, or a verifier registered in --redis-url")
    score.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                       help="pool processes (default: CPU count - 1)")
    score.add_argument("--deadline-s", type=float, default=10.0, help="per-record deadline in seconds")
    score.add_argument("--verifier-plugin", type=_plugin, action="append", default=[], metavar="NAME=SPEC",
                       help="extra local verifier, NAME=package.module:function (repeatable)")
    score.add_argument("--redis-url", default=env_redis_url(),
                       help="Redis holding the registered remote verifiers (default: $REDIS_URL)")
    add_verifier_allow(score)
    from services.common.security import add_security_args

    add_security_args(score, server=False, token=False, tls=False)  # --redis-url-file: a URL with a password
    score.add_argument("--quiet", action="store_true", help="no progress line")
    score.set_defaults(func=run_score)

    from services.common.security import add_security_args

    for name, help_text in (("register", "register a remote verifier (needs the token)"),
                            ("unregister", "remove a registered verifier (needs the token)"),
                            ("list", "list the verifiers a worker knows")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--worker", required=True, help="HOST:PORT of any reward worker")
        add_security_args(command, server=False, token=name != "list", redis=False)
        if name != "list":
            command.add_argument("--name", required=True, help="verifier name used in verifier_function")
        if name == "register":
            command.add_argument("--endpoint", required=True, help="HOST:PORT of the rlfabric.v1.Verifier server")
            command.add_argument("--version", default="1", help="version recorded with every score")
            command.add_argument("--timeout-s", type=float, default=0.0, help="per-sample deadline (0: 10 s)")
            command.add_argument("--max-concurrency", type=int, default=0, help="calls at once per worker (0: 16)")
            command.add_argument("--description", default="", help="one line shown by `list`")
        command.set_defaults(func=run_registry_command)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser, default_address="127.0.0.1:0",
                          redis_help="Redis for membership and the verifier registry (default: $REDIS_URL)")
    parser.add_argument("--processes", type=int, default=1, help="verifier pool processes (default: 1)")
    parser.add_argument("--worker-id", default="", help="instance id in the registry (default: host-pid-random)")
    parser.add_argument("--deadline-s", type=float, default=10.0,
                        help="per-sample deadline when a request sets none (default: 10)")
    parser.add_argument("--verifier-plugin", type=_plugin, action="append", default=[], metavar="NAME=SPEC",
                        help="extra local verifier, NAME=package.module:function or NAME=/path/file.py:function")
    parser.add_argument("--lease-s", type=float, default=10.0, help="registry lease (heartbeat every lease/3)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free port)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM: deregister, finish the samples held, exit; streams still open after this "
                             "long are cancelled and their samples re-sent elsewhere (default: 30)")
    add_verifier_allow(parser)
    from services.common.security import add_security_args

    add_security_args(parser)  # the token guards RegisterVerifier/UnregisterVerifier


def add_verifier_allow(parser: argparse.ArgumentParser) -> None:
    from services.reward.endpoints import DEFAULT_ALLOW

    parser.add_argument("--verifier-allow", default=DEFAULT_ALLOW, metavar="PATTERN,...",
                        help="hosts a registered remote verifier may live on: loopback, members (hosts of the "
                             "registered rlfabric services), *, an IP, a CIDR or a host glob; link-local and "
                             f"metadata addresses never (default: {DEFAULT_ALLOW})")


def run_serve(args: argparse.Namespace) -> int:
    from services.common.security import server_security
    from services.reward.worker import RewardWorker, RewardWorkerOptions

    try:
        security = server_security(args, "rlfabric.v1.Reward")
    except ValueError as e:
        print(f"rlfabric reward serve: {e}", file=sys.stderr)
        return 2
    bad = check_network_arguments(args)
    if bad:
        print(f"rlfabric reward serve: {bad}", file=sys.stderr)
        return 2
    options = RewardWorkerOptions(
        address=args.address, processes=args.processes, redis_url=args.redis_url, auth_token=args.auth_token,
        worker_id=args.worker_id, deadline_s=args.deadline_s, verifier_allow=args.verifier_allow,
        plugins=dict(args.verifier_plugin), lease_s=args.lease_s, metrics_port=args.metrics_port,
        advertise_address=args.advertise_address, advertise_interface=args.advertise_interface,
        insecure=security.mode == "insecure",
    )
    try:
        worker = RewardWorker(options).start()
    except ValueError as e:  # a bad flag value (deadline, plugin, --verifier-allow): say which, no traceback
        print(f"rlfabric reward serve: {e}", file=sys.stderr)
        return 2
    # One parseable line for launchers and tests that started us with port 0.
    print(f"reward worker {worker.worker_id} listening on {worker.endpoint} metrics :{worker.server.metrics_port}",
          flush=True)
    try:
        worker.serve_until_signal(args.drain_timeout_s)
    finally:
        worker.stop()
    return 0


def run_score(args: argparse.Namespace) -> int:
    from pathlib import Path

    source, out = Path(args.input), Path(args.out)
    if not source.is_file():  # before the verifiers' imports and pool
        what = "is a directory; pass a .jsonl file" if source.is_dir() else "not found"
        print(f"rlfabric reward score: input file {source} {what}", file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"rlfabric reward score: --out {out}: folder {out.parent} not found; create it first", file=sys.stderr)
        return 2
    from services.common.security import resolve_secrets
    from services.reward.offline import open_verifier, print_progress, score_jsonl

    try:
        resolve_secrets(args)
        with open_verifier(args.verifier, plugins=dict(args.verifier_plugin), processes=args.processes,
                           redis_url=args.redis_url, verifier_allow=args.verifier_allow) as submit:
            summary = score_jsonl(source, out, submit, deadline_s=args.deadline_s,
                                  progress=None if args.quiet else print_progress())
    except OSError as e:  # a sentence, not "[Errno 13] ..."
        print(f"rlfabric reward score: cannot use {e.filename or args.input}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"rlfabric reward score: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0


def run_registry_command(args: argparse.Namespace) -> int:
    from rlfabric.v1 import reward_pb2_grpc
    from services.common.client_command import call_service

    return call_service(f"rlfabric reward {args.reward_command}", args, args.worker, reward_pb2_grpc.RewardStub,
                        lambda stub: _registry_calls(args, stub))


def _registry_calls(args: argparse.Namespace, stub) -> int:
    from rlfabric.v1 import reward_pb2
    from services.common.deadlines import DEFAULT_DEADLINE_S

    if args.reward_command == "register":
        reply = stub.RegisterVerifier(reward_pb2.RegisterVerifierRequest(
            name=args.name, version=args.version, endpoint=args.endpoint, timeout_s=args.timeout_s,
            max_concurrency=args.max_concurrency, description=args.description), timeout=DEFAULT_DEADLINE_S)
        print(f"registered {reply.verifier.name} v{reply.verifier.version} at {reply.verifier.endpoint}")
    elif args.reward_command == "unregister":
        stub.UnregisterVerifier(reward_pb2.UnregisterVerifierRequest(name=args.name), timeout=DEFAULT_DEADLINE_S)
        print(f"unregistered {args.name}")
    else:
        reply = stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=DEFAULT_DEADLINE_S)
        for info in reply.verifiers:
            where = "built-in" if info.builtin else info.endpoint
            print(f"{info.name:20s} v{info.version:8s} {where:22s} {info.description}")
    return 0
