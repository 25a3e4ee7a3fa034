"""The `rlfabric` command: one entry point, one subcommand module per area.

Each module in SUBCOMMAND_MODULES exposes `add_subcommands(subparsers)`; it declares its parsers and sets
`func` on each, a callable taking the parsed args and returning an exit code. Only the chosen subcommand's
heavy imports load (they live inside the funcs), so `rlfabric --help` stays fast.

Exit codes, one per class of failure: 0 done, 2 a usage or configuration mistake the user can fix (a bad flag, a
config error, a file or folder that is not there), 1 a runtime failure (a service that did not start, a run that
failed), 130 interrupted. A `DataError` (ConfigError among them) that reaches here is a user's mistake: it is
printed as its one-line message, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

EXIT_USAGE = 2  # what argparse exits with for a bad flag; every user mistake gets it

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "services.common.cli",
    "services.common.config_cli",
    "services.data.cli",
    "services.trainer.cli",
    "services.rollout.cli",
    "services.reward.cli",
    "services.tools.cli",
    "services.coordinator.cli",
    "services.launcher.train_cli",
    "services.launcher.eval_cli",
    "services.launcher.cli",
    "services.launcher.system_cli",
    "services.sft.cli",
    "services.report.cli",
    "services.planning.cli",
    "services.sandbox.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfabric",
        description="GRPO post-training as gRPC services, compatible with MindSpeed-RL configs and data.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    parser.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from services.common.logs import setup_logging

    setup_logging(args.log_level, json_format=args.log_json)
    from services.common.errors import DataError

    try:
        return int(args.func(args) or 0)
    except DataError as e:  # ConfigError is one
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        logging.shutdown()
        return 1


if __name__ == "__main__":
    sys.exit(main())
