"""Which hosts a registered remote verifier may live on: the workers' `--verifier-allow` list.

A registered endpoint makes every worker open connections to it, and whoever holds the token, or can
write the Redis registry, chooses it. So a worker checks every endpoint when `RegisterVerifier` is
called and again when it loads an entry from Redis:
- never allowed: link-local addresses (169.254.0.0/16, fe80::/10, where cloud metadata services
  answer), the metadata names and addresses below, unspecified (0.0.0.0, ::) and multicast addresses;
- allowed: a host that matches one pattern of the comma-separated list. A pattern is `loopback`
  (127.0.0.0/8, ::1), `members` (the hosts of the rlfabric services registered in Redis), `*` (any
  host but the never-list), an IP address, a CIDR network (`10.0.0.0/8`), or a host name glob
  (`*.verifiers.svc.cluster.local`). Default: `loopback,members`.
A host name is resolved and every address it resolves to must pass too, so a name pointing at a
metadata address is refused; a name that does not resolve is refused.
"""

import fnmatch
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from services.common.redis_store import Registry
from services.common.service_kind import ServiceKind
from services.common.status import echo

logger = logging.getLogger(__name__)

DEFAULT_ALLOW = "loopback,members"
# Metadata services that are not (only) on link-local addresses.
_METADATA_NAMES = frozenset({"metadata.google.internal", "metadata", "instance-data", "instance-data.ec2.internal"})
_METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class EndpointRefusedError(ValueError):
    """The endpoint's host is not allowed (the message says why and what to change)."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError naming the endpoint otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {echo(endpoint)} must be 'host:port' with a port in 1..65535")
    return host, int(port)


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(host: str) -> set[Address]:
    literal = _literal(host)
    if literal is not None:
        return {literal}
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        raise EndpointRefusedError(f"host {echo(host)} does not resolve ({e})") from e
    return {ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos}


def _never(address: Address) -> bool:
    return (address.is_link_local or address.is_unspecified or address.is_multicast
            or address in _METADATA_ADDRESSES)


@dataclass(frozen=True)
class EndpointPolicy:
    """The allow-list of one worker (or of `rlfabric reward score`).

    Args:
        patterns: the `--verifier-allow` patterns (see the module docstring).
        member_hosts: returns the hosts of the registered rlfabric services (for `members`).
    """

    patterns: tuple[str, ...]
    member_hosts: Callable[[], Iterable[str]] = field(default=lambda: ())

    @classmethod
    def parse(cls, text: str, member_hosts: Callable[[], Iterable[str]] | None = None) -> "EndpointPolicy":
        """Reads a comma-separated `--verifier-allow`; ValueError naming a malformed pattern."""
        patterns = tuple(p.strip() for p in text.split(",") if p.strip())
        if not patterns:
            raise ValueError("--verifier-allow is empty; use 'loopback' at least (or '*' for any host)")
        for pattern in patterns:
            if "/" in pattern:
                try:
                    ipaddress.ip_network(pattern, strict=False)
                except ValueError as e:
                    raise ValueError(f"--verifier-allow pattern {pattern!r} is not a CIDR network: {e}") from e
        return cls(patterns, member_hosts or (lambda: ()))

    def check(self, endpoint: str) -> None:
        """Raises EndpointRefusedError (or ValueError for a malformed endpoint) unless `endpoint` is allowed."""
        host, _port = split_endpoint(endpoint)
        name = host.lower().rstrip(".")
        never = EndpointRefusedError(f"endpoint {echo(endpoint)} is a link-local, metadata, unspecified or multicast "
                                "address; verifiers are never allowed there")
        if name in _METADATA_NAMES:
            raise never
        addresses = _resolve(host)
        if any(_never(a) for a in addresses):
            raise never
        if not any(self._matches(pattern, name, addresses) for pattern in self.patterns):
            raise EndpointRefusedError(f"endpoint {echo(endpoint)} is not allowed by --verifier-allow "
                                  f"{','.join(self.patterns)!r}; start the workers with a pattern that "
                                  f"matches it (a host name, glob, IP address or CIDR network)")

    def _matches(self, pattern: str, name: str, addresses: set[Address]) -> bool:
        if pattern == "*":
            return True
        if pattern == "loopback":
            return all(a.is_loopback for a in addresses)
        if pattern == "members":
            hosts = {h.lower() for h in self.member_hosts()}
            return name in hosts or any(str(a) in hosts for a in addresses)
        if "/" in pattern:
            network = ipaddress.ip_network(pattern, strict=False)
            return all(a.version == network.version and a in network for a in addresses)
        literal = _literal(pattern)
        if literal is not None:
            return addresses == {literal}
        return fnmatch.fnmatchcase(name, pattern.lower())


# The registry services whose hosts `--verifier-allow members` admits.
_RLFABRIC_SERVICES = (ServiceKind.ROLLOUT, ServiceKind.TRAINER, ServiceKind.REWARD, ServiceKind.COORDINATOR)


def member_hosts(registry: Registry | None) -> set[str]:
    """Hosts of the rlfabric services registered in Redis (none when Redis is unreachable)."""
    hosts: set[str] = set()
    if registry is None:
        return hosts
    for service in _RLFABRIC_SERVICES:
        try:
            members = registry.members(service)
        except (redis.RedisError, ValueError, KeyError) as e:  # unreachable, or a malformed member entry
            logger.warning("could not read the %s members from Redis for --verifier-allow: %s", service, e)
            continue
        for member in members:
            try:
                hosts.add(split_endpoint(member.endpoint)[0])
            except ValueError:
                continue
    return hosts
