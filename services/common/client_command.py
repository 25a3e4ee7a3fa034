"""A CLI command's call to one service: the client's credentials from the command's flags, then the stub's calls;
a set-up mistake exits 2 and an RPC error 1, each as one line that names the command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import grpc

from services.common.client import make_channel
from services.common.security import configure_client


def call_service(command: str, args: argparse.Namespace, address: str, stub_class: Callable[[grpc.Channel], Any],
                 calls: Callable[[Any], int]) -> int:
    """`calls(stub)` against `address` for `command` (e.g. "rlfabric tools list"); returns its exit code."""
    try:
        configure_client(args)
    except ValueError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    try:
        return calls(stub_class(make_channel(address)))
    except grpc.RpcError as e:
        print(f"{command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
