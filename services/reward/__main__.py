"""`python -m services.reward [serve flags]`: run one reward worker (same flags as `rlfabric reward serve`)."""

import argparse
import logging
import os
import sys

from services.reward.cli import add_serve_arguments, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.reward", description="Run one reward worker.")
    add_serve_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("RLFABRIC_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
