"""Network odds and ends shared by the services' launchers."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for a server or a torch.distributed master).

    Drawn at random from below the kernel's ephemeral range: a port the kernel handed out for `bind(0)` is
    also what it hands to outgoing connections, so between this call and the real bind another process's
    client socket could take it (EADDRINUSE in torch.distributed's store under load).
    """
    low, _ = _ephemeral_range()
    candidates = range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1000 else range(1024, low)
    # SystemRandom: processes that seeded `random` alike (tests, trainer ranks) must not draw alike.
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # everything below the range is taken
        s.bind((host, 0))
        return s.getsockname()[1]
