"""Network odds and ends shared by the services' launchers: free ports, and the one home of the flags that say
where a service listens (bind) and where the others reach it (advertise).

Every `serve` command takes, through `add_network_arguments`:
  --address HOST:PORT          what the gRPC server binds (0.0.0.0 / [::] for every interface; port 0: any free)
  --advertise-address HOST[:PORT]  what it registers in Redis, i.e. what other hosts dial; without a port the
                               bound port is used. Default: the bound host, or for a wildcard bind the first
                               address of --advertise-interface, else this host's name.
  --advertise-interface NAME   take the advertised host from this network interface (the seed's CURRENT_IP /
                               SOCKET_IFNAME: on a multi-homed node, the interface the cluster's traffic uses)
  --redis-url URL              the membership Redis (default: $REDIS_URL, as every service reads it)
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import random
import socket
import struct
from pathlib import Path

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
_SIOCGIFADDR = 0x8915
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


def env_redis_url() -> str | None:
    """`$REDIS_URL`: the default of every command's `--redis-url` (the one place that reads it)."""
    return os.environ.get("REDIS_URL")


def add_network_arguments(p: argparse.ArgumentParser, *, default_address: str, redis_help: str | None = None,
                          redis_required: bool = False) -> None:
    """The bind / advertise / Redis flags of a `serve` command (see the module doc)."""
    p.add_argument("--address", default=default_address,
                   help=f"gRPC bind address HOST:PORT (default {default_address}; port 0: a free port)")
    p.add_argument("--advertise-address", "--advertise-host", dest="advertise_address", default=None,
                   metavar="HOST[:PORT]",
                   help="address other hosts use to reach this service, registered in Redis (default: the bound "
                        "host; for a wildcard bind, --advertise-interface's address or this host's name)")
    p.add_argument("--advertise-interface", default=None, metavar="IFNAME",
                   help="advertise the IPv4 address of this interface (CURRENT_IP of the seed's launcher)")
    env_url = env_redis_url()
    p.add_argument("--redis-url", default=env_url, required=redis_required and env_url is None,
                   help=redis_help or "Redis holding service membership (default: $REDIS_URL)")


def split_host_port(address: str) -> tuple[str, int | None]:
    """("host", port) of "host:port", "[v6]:port", "host" or "[v6]"; ValueError naming the address."""
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"address {address!r}: expected [IPv6]:PORT")
        port = rest[1:] if rest else ""
    elif text.count(":") > 1:  # a bare IPv6 address, no port
        host, port = text, ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"address {address!r}: no host")
    if port and not (port.isdigit() and int(port) < 65536):
        raise ValueError(f"address {address!r}: port must be 0-65535")
    return host, int(port) if port else None


def join_host_port(host: str, port: int) -> str:
    """"host:port", with brackets around an IPv6 literal (what gRPC targets need)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass  # a name, not a literal
    return f"{host}:{port}"


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface `ifname`; ValueError naming it when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise ValueError(f"--advertise-interface {ifname}: no IPv4 address ({e.strerror})") from e
    return socket.inet_ntoa(packed[20:24])


def advertised_address(args: argparse.Namespace, bound_port: int) -> str:
    """What this service registers: --advertise-address (its port, else the bound one), else
    --advertise-interface's address, else the host of --address unless it is a wildcard, else this host's name."""
    bound_host = split_host_port(args.address)[0]
    given = getattr(args, "advertise_address", None)
    if given:
        host, port = split_host_port(given)
        return join_host_port(host, port or bound_port)
    ifname = getattr(args, "advertise_interface", None)
    if ifname:
        return join_host_port(interface_address(ifname), bound_port)
    if bound_host.strip("[]") in WILDCARD_HOSTS:
        return join_host_port(socket.gethostname(), bound_port)
    return join_host_port(bound_host.strip("[]"), bound_port)


def check_network_arguments(args: argparse.Namespace) -> str | None:
    """The first bad network flag as a message naming it, else None (called before anything starts)."""
    try:
        split_host_port(args.address)
        if getattr(args, "advertise_address", None):
            split_host_port(args.advertise_address)
        if getattr(args, "advertise_interface", None):
            interface_address(args.advertise_interface)
    except ValueError as e:
        return str(e)
    return None
