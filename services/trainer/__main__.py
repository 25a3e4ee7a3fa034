"""`python -m services.trainer ARGS` is `rlfabric trainer ARGS` (torchrun runs `-m services.trainer rank ...`).

The flags are declared once, in cli.py; this module only hands the command line to the `rlfabric` parser.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from services.cli import main as rlfabric

    return rlfabric(["trainer", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
