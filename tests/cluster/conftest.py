"""Hosts for the multi-host tests: network namespaces, each with its own `eth0` and address, joined by veth
links to a bridge that lives in a namespace of its own (so nothing is left in the root namespace but one
observer link, and deleting the namespaces removes every link).

The observer link gives the test process (the operator's machine) an address on the same network, to read
Redis, health and metrics the way an operator would; the services never use it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True)
class Host:
    """One namespace: `ns` to run in, `ip` its address on the shared network (interface eth0)."""

    name: str
    ns: str
    ip: str

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Network:
    subnet: str  # "10.N.0"
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    observer_link: str = ""

    @property
    def observer_ip(self) -> str:
        return f"{self.subnet}.254"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=10).stdout
    for second in range(77, 250):
        if f"10.{second}." not in routes:
            return f"10.{second}.0"
    raise RuntimeError("no free 10.N.0.0/24 subnet for the test network")


def build_network(net: Network, names: list[str]) -> None:
    """Namespaces `names` (10.N.0.1, .2, ...) on one bridge, plus the observer link at 10.N.0.254; what is
    made is recorded in `net` as it is made, so that `remove_network` undoes a half-built one."""
    tag = f"rlf{os.getpid() % 100000}"
    switch = f"{tag}sw"
    _ip("netns", "add", switch)
    net.namespaces.append(switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for i, name in enumerate(names, start=1):
        ns, host_end, switch_end = f"{tag}{name}", f"{tag}h{i}", f"{tag}s{i}"
        _ip("netns", "add", ns)
        net.namespaces.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _ip("link", "set", switch_end, "netns", switch)
        _ip("-n", switch, "link", "set", switch_end, "master", "br0", "up")
        _ip("link", "set", host_end, "netns", ns)
        _ip("-n", ns, "link", "set", host_end, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{net.subnet}.{i}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        net.hosts[name] = Host(name, ns, f"{net.subnet}.{i}")
    _ip("link", "add", f"{tag}op", "type", "veth", "peer", "name", f"{tag}so")
    net.observer_link = f"{tag}op"
    _ip("link", "set", f"{tag}so", "netns", switch)
    _ip("-n", switch, "link", "set", f"{tag}so", "master", "br0", "up")
    _ip("addr", "add", f"{net.observer_ip}/24", "dev", net.observer_link)
    _ip("link", "set", net.observer_link, "up")


def remove_network(net: Network) -> None:
    if net.observer_link:
        subprocess.run(["ip", "link", "del", net.observer_link], capture_output=True, timeout=30)
    for ns in reversed(net.namespaces):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """Three hosts a, b, c; skipped, saying why, where namespaces cannot be made (not root, no `ip`, no veth)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add); run the suite as root or in a privileged container")
    net = Network("")
    try:
        net.subnet = _free_subnet()
        build_network(net, ["a", "b", "c"])
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    except subprocess.CalledProcessError as e:
        remove_network(net)
        pytest.skip(f"cannot make network namespaces / veth links here: `{' '.join(e.cmd)}`: {e.stderr.strip()}")
    try:
        yield net
    finally:
        remove_network(net)
