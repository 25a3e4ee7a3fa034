"""`rlfabric sandbox serve`: the code sandbox, speaking SandboxFusion's /run_code.

    rlfabric sandbox serve --port 8080 --num-workers 4 --rate-limit 16
    # MindSpeed-RL's tool YAML then points at it unchanged: sandbox_fusion_url: http://HOST:8080/run_code
Heavy imports happen inside the command, so `rlfabric --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    sandbox = subparsers.add_parser("sandbox", help="the code sandbox service (SandboxFusion's /run_code API)")
    commands = sandbox.add_subparsers(dest="sandbox_command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help="run the sandbox HTTP server (bubblewrap isolation)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1; anyone who reaches the port can run code in the "
                            "sandbox, as with SandboxFusion, so bind a routable address only on a trusted network)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080, SandboxFusion's; 0: a free one)")
    serve.add_argument("--num-workers", type=int, default=max(1, os.cpu_count() or 1),
                       help="runs at once (default: CPU count); more wait in the queue")
    serve.add_argument("--rate-limit", type=float, default=0.0,
                       help="run starts per second, bursts up to max(1, this) (default: 0, no rate limit)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="requests that may wait for a worker; more are refused with HTTP 429 (default: 256)")
    serve.add_argument("--queue-timeout-s", type=float, default=60.0,
                       help="longest wait for a worker before HTTP 429 (default: 60)")
    serve.add_argument("--max-run-timeout-s", type=float, default=60.0,
                       help="largest run_timeout a request may ask for; more is refused (default: 60)")
    serve.add_argument("--max-memory-mb", type=int, default=4096,
                       help="largest memory_limit_MB a request may ask for, and the limit of one that sends -1: the "
                            "address space of each process (default: 4096)")
    serve.add_argument("--max-processes", type=int, default=64,
                       help="processes and threads one run may have at once (default: 64)")
    serve.add_argument("--max-output-bytes", type=int, default=1 << 20,
                       help="stdout and stderr kept per stream; a run writing more is truncated and killed "
                            "(default: 1048576)")
    serve.add_argument("--max-file-size-mb", type=int, default=64, help="largest file a run may write (default: 64)")
    serve.add_argument("--max-scratch-mb", type=int, default=256,
                       help="size of a run's scratch folder, and separately of its /tmp (default: 256)")
    serve.add_argument("--max-open-files", type=int, default=256, help="open files per process (default: 256)")
    serve.add_argument("--max-request-mb", type=int, default=64, help="largest request body (default: 64)")
    serve.add_argument("--python", default=sys.executable,
                       help="the interpreter that runs the code, with its packages (default: this one, with the "
                            "venv's numpy and sympy); its folders are mounted read-only in the sandbox")
    serve.add_argument("--scratch-root", default=None,
                       help="host folder for the runs' scratch folders (default: the system temp folder)")
    serve.add_argument("--sandbox-uid-base", type=int, default=2_000_000_000,
                       help="when run as root: worker slot i runs as uid BASE+i, a range no account uses "
                            "(default: 2000000000)")
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from services.sandbox.runner import Sandbox, SandboxLimits, SandboxUnavailableError
    from services.sandbox.server import create_server, serve

    try:
        limits = SandboxLimits(
            max_run_timeout_s=args.max_run_timeout_s, max_memory_mb=args.max_memory_mb,
            max_processes=args.max_processes, max_output_bytes=args.max_output_bytes,
            max_file_size_mb=args.max_file_size_mb, max_scratch_mb=args.max_scratch_mb,
            max_open_files=args.max_open_files)
        if args.sandbox_uid_base < 1 or args.sandbox_uid_base + args.num_workers > 2**32 - 2:
            raise ValueError(f"--sandbox-uid-base {args.sandbox_uid_base}: uids BASE..BASE+num_workers must lie in "
                             "1..4294967294")
    except ValueError as e:
        print(f"rlfabric sandbox serve: {e}", file=sys.stderr)
        return 2
    try:
        sandbox = Sandbox(limits, python=args.python, scratch_root=args.scratch_root, uid_base=args.sandbox_uid_base)
    except SandboxUnavailableError as e:
        print(f"rlfabric sandbox serve: {e}", file=sys.stderr)
        return 1
    try:
        sandbox.check()
        server = create_server(host=args.host, port=args.port, sandbox=sandbox, num_workers=args.num_workers,
                               rate_limit=args.rate_limit, max_queue=args.max_queue,
                               queue_timeout_s=args.queue_timeout_s, max_request_mb=args.max_request_mb)
    except SandboxUnavailableError as e:
        sandbox.close()
        print(f"rlfabric sandbox serve: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        sandbox.close()
        print(f"rlfabric sandbox serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        sandbox.close()
        print(f"rlfabric sandbox serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    info = sandbox.describe()
    print(f"sandbox serving on {server.url} (bubblewrap, {info['mode']} mode; python {info['python']}; "
          f"{args.num_workers} workers, rate limit {args.rate_limit:g}/s); metrics at /metrics, health at /health",
          flush=True)
    serve(server)
    return 0
