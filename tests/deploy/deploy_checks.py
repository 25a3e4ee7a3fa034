"""Helpers of the offline deployment checks (tests/deploy): paths, constants, and argv checks against
the real parsers. Fixtures live in conftest.py."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
JEMALLOC = "/usr/local/lib/libjemalloc.so.2"  # what the images create and the manifests preload
ENTRYPOINT = ["rlfabric-exec", "rlfabric"]  # every image's ENTRYPOINT
CONFIGS_MOUNT = "/etc/rlfabric/configs"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def load_json(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())


def grpc_service(component: str) -> str:
    """The full gRPC service name a component serves, from the generated stubs (the contract)."""
    from rlfabric.v1 import coordinator_pb2, reward_pb2, rollout_pb2, trainer_pb2

    module = {"coordinator": coordinator_pb2, "rollout": rollout_pb2, "reward": reward_pb2, "trainer": trainer_pb2}
    (service,) = module[component].DESCRIPTOR.services_by_name.values()
    return service.full_name


def substitute(value: str, env: dict[str, str]) -> str:
    """Expands Kubernetes-style $(VAR) references, failing on one that is not defined."""
    def one(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) in {value!r} is not defined for this container"
        return env[m.group(1)]

    return VAR_REF.sub(one, value)


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_argv(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parses argv with the real parser and refuses abbreviated or unknown flags (argparse accepts
    unambiguous prefixes, which would hide a renamed flag)."""
    allowed = option_strings(parser)
    current = parser
    for token in argv:
        children = _subparsers(current)
        if token in children:
            current = children[token]
            allowed |= option_strings(current)
        elif token.startswith("--"):
            flag = token.split("=", 1)[0]
            assert flag in allowed, f"{flag} is not a flag of `{current.prog}` (known: {sorted(allowed)})"
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"`{parser.prog} {' '.join(argv)}` does not parse (exit {e.code})") from e


