"""`python -m services.trainer serve|rank ...`: the trainer group launcher and one rank's entry point.

`serve` starts one process per rank (see launch.py); `rank` is what each of those runs (also usable
under torchrun, which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
"""

from __future__ import annotations

import argparse
import sys

from services.trainer.launch import add_serve_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="start every rank and supervise them"))
    add_serve_arguments(sub.add_parser("rank", help="run one rank (environment gives RANK etc.)"))
    args = parser.parse_args(argv)
    from services.common.logs import setup_logging

    setup_logging(args.log_level)
    from services.trainer import launch

    if args.command == "serve":
        return launch.serve_group(args)
    return launch.run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
