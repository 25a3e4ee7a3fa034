"""`rlfabric tools ...`: serve the tools of MindSpeed-RL tool YAMLs, a BM25 retrieval server, and probe a server.

    rlfabric tools serve --tool-config retool_config.yaml --redis-url-file URL_FILE --auth-token-file TOKEN_FILE
    rlfabric tools retrieval-serve --corpus corpus.jsonl --port 8000
    rlfabric tools list --server HOST:PORT
    rlfabric tools call --server HOST:PORT --auth-token-file TOKEN_FILE --name code_interpreter \\
        --arguments '{"code": "print(2 ** 100)"}'
Heavy imports happen inside the commands, so `rlfabric --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.common.net import add_network_arguments, check_network_arguments

logger = logging.getLogger(__name__)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    tools = subparsers.add_parser("tools", help="tool servers for multi-turn rollouts (code interpreter, search)")
    commands = tools.add_subparsers(dest="tools_command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="host the tools of MindSpeed-RL tool YAMLs (register them in Redis)")
    serve.add_argument("--tool-config", action="append", required=True, metavar="YAML",
                       help="a MindSpeed-RL tool YAML (tools: [{class_name, config, tool_schema}]); repeatable, "
                            "tool names must differ across files")
    add_network_arguments(serve, default_address="127.0.0.1:0",
                          redis_help="Redis for membership and the global rate_limit (default: $REDIS_URL)")
    serve.add_argument("--instance-id", default="", help="id in the registry (default: host-pid-random)")
    serve.add_argument("--lease-s", type=float, default=10.0, help="registry lease (heartbeat every lease/3)")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free port)")
    serve.add_argument("--max-result-chars", type=int, default=65_536,
                       help="longest text one call answers; longer output is cut, saying so (default: 65536)")
    serve.add_argument("--drain-timeout-s", type=float, default=30.0,
                       help="on SIGTERM: deregister, let calls finish for this long, then stop (default: 30)")
    from services.common.security import add_security_args

    add_security_args(serve)  # the token guards Call
    serve.set_defaults(func=run_serve)

    retrieval = commands.add_parser("retrieval-serve",
                                    help="serve Search-R1's /retrieve API with BM25 over a corpus JSONL")
    retrieval.add_argument("--corpus", required=True, metavar="JSONL",
                           help="one {\"id\": ..., \"contents\": \"Title\\ntext\"} object per line")
    retrieval.add_argument("--host", default="127.0.0.1", help="bind host (default: 127.0.0.1)")
    retrieval.add_argument("--port", type=int, default=8000, help="bind port (0: a free one; default: 8000)")
    retrieval.add_argument("--topk", type=int, default=3, help="hits per query when a request sets none (default 3)")
    retrieval.set_defaults(func=run_retrieval_serve)

    for name, help_text in (("list", "list the tools a server hosts"), ("call", "make one tool call")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--server", required=True, help="HOST:PORT of a tool server")
        add_security_args(command, server=False, token=name == "call", redis=False)
        if name == "call":
            command.add_argument("--name", required=True, help="tool name")
            command.add_argument("--arguments", default="{}", help="the arguments, a JSON object (default: {})")
            command.add_argument("--deadline-s", type=float, default=0.0, help="call deadline (0: the tool's)")
        command.set_defaults(func=run_client_command)


def load_tool_configs(paths: list[str]):
    """The tools of every YAML in `paths` as one ToolConfigFile; ConfigError for a bad file or a name used twice."""
    from services.common.config.errors import ConfigError, ConfigIssue
    from services.common.config.tools import ToolConfigFile, load_tool_config

    files = [load_tool_config(p) for p in paths]
    seen: dict[str, str] = {}
    issues = []
    for f in files:
        for entry in f.tools:
            if entry.name in seen:
                issues.append(ConfigIssue(f"tools[{entry.index}].tool_schema.function.name",
                                          f"tool {entry.name!r} is also defined in {seen[entry.name]}", f.path))
            seen.setdefault(entry.name, f.path)
    if issues:
        raise ConfigError(issues)
    return ToolConfigFile(",".join(paths), tuple(t for f in files for t in f.tools))


def run_serve(args: argparse.Namespace) -> int:
    from services.common.security import server_security
    from services.tools.worker import ToolWorker, ToolWorkerOptions

    try:
        security = server_security(args)
    except ValueError as e:
        print(f"rlfabric tools serve: {e}", file=sys.stderr)
        return 2
    bad = check_network_arguments(args)
    if bad:
        print(f"rlfabric tools serve: {bad}", file=sys.stderr)
        return 2
    config = load_tool_configs(args.tool_config)  # a ConfigError is printed by services/cli.py (exit 2)
    if security.mode == "token":
        logger.info("auth: token; Call needs --auth-token-file's token")
    elif security.mode == "insecure":
        logger.warning("auth: INSECURE (--insecure, no --auth-token-file); Call is open to every caller")
    else:
        logger.warning("auth: closed (no --auth-token-file); Call refuses every caller; give --auth-token-file, "
                       "or --insecure to open it")
    options = ToolWorkerOptions(
        address=args.address, redis_url=args.redis_url, auth_token=args.auth_token,
        insecure=security.mode == "insecure", instance_id=args.instance_id, lease_s=args.lease_s,
        metrics_port=args.metrics_port, advertise_address=args.advertise_address,
        advertise_interface=args.advertise_interface, max_result_chars=args.max_result_chars,
    )
    try:
        worker = ToolWorker(config, options).start()
    except ValueError as e:
        print(f"rlfabric tools serve: {e}", file=sys.stderr)
        return 2
    # One parseable line for launchers and tests that started us with port 0.
    print(f"tool server {worker.instance_id} listening on {worker.endpoint} metrics :{worker.server.metrics_port} "
          f"tools {','.join(worker.host.tools)}", flush=True)
    try:
        worker.serve_until_signal(args.drain_timeout_s)
    finally:
        worker.stop()
    return 0


def run_retrieval_serve(args: argparse.Namespace) -> int:
    from services.common.stop_signal import wait_for_stop_signal
    from services.tools.retrieval import RetrievalServer

    try:
        server = RetrievalServer(args.corpus, host=args.host, port=args.port, topk=args.topk)
    except OSError as e:
        print(f"rlfabric tools retrieval-serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    except ValueError as e:  # DataError (the corpus) or a bad --topk
        print(f"rlfabric tools retrieval-serve: {e}", file=sys.stderr)
        return 2
    server.start()
    print(f"retrieval server listening on {server.url} ({server.index.size} documents)", flush=True)
    wait_for_stop_signal()
    server.stop()
    return 0


def run_client_command(args: argparse.Namespace) -> int:
    from rlfabric.v1 import tool_pb2_grpc
    from services.common.client_command import call_service

    return call_service(f"rlfabric tools {args.tools_command}", args, args.server, tool_pb2_grpc.ToolStub,
                        lambda stub: _client_calls(args, stub))


def _client_calls(args: argparse.Namespace, stub) -> int:
    from rlfabric.v1 import tool_pb2
    from services.common.deadlines import DEFAULT_DEADLINE_S

    if args.tools_command == "list":
        reply = stub.ListTools(tool_pb2.ListToolsRequest(), timeout=DEFAULT_DEADLINE_S)
        for info in reply.tools:
            print(f"{info.name:20s} {info.implementation:50s} workers={info.max_concurrency} "
                  f"deadline={info.default_deadline_s:g}s  {info.description}")
        return 0
    rpc_timeout = (args.deadline_s or 3600.0) + 5.0
    reply = stub.Call(tool_pb2.ToolCallRequest(call_id="cli", name=args.name, arguments_json=args.arguments,
                                               deadline_s=args.deadline_s), timeout=rpc_timeout)
    status = tool_pb2.ToolCallStatus.Name(reply.status).removeprefix("TOOL_CALL_STATUS_")
    print(f"{status} in {reply.latency_s:.2f} s" + (f" ({reply.error})" if reply.error else ""), file=sys.stderr)
    print(reply.text)
    return 0 if status == "OK" else 1
