"""Verifier endpoints against the `--verifier-allow` list: what is allowed, what never is."""

import grpc
import pytest

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_channel
from services.reward.endpoints import EndpointPolicy, EndpointRefusedError


@pytest.mark.parametrize(("allow", "endpoint"), [
    ("loopback", "127.0.0.1:50070"),
    ("loopback", "127.8.9.10:1"),
    ("loopback", "[::1]:50070"),
    ("loopback", "localhost:50070"),
    ("10.0.0.0/8", "10.1.2.3:50070"),
    ("10.1.2.3", "10.1.2.3:50070"),
    ("*", "10.1.2.3:50070"),
    ("loopback,192.168.0.0/16", "192.168.4.5:1"),
    ("members", "10.9.9.9:7"),  # a host an rlfabric service registered from
])
def test_allowed(allow, endpoint):
    EndpointPolicy.parse(allow, lambda: {"10.9.9.9"}).check(endpoint)


@pytest.mark.parametrize(("allow", "endpoint", "why"), [
    ("*", "169.254.169.254:80", "never allowed"),  # the cloud metadata service, even with *
    ("169.254.0.0/16", "169.254.10.1:80", "never allowed"),  # link-local cannot be allowed at all
    ("*", "[fe80::1]:80", "never allowed"),
    ("*", "[fd00:ec2::254]:80", "never allowed"),  # AWS metadata over IPv6
    ("*", "metadata.google.internal:80", "never allowed"),
    ("*", "0.0.0.0:80", "never allowed"),
    ("loopback", "10.1.2.3:50070", "not allowed by --verifier-allow 'loopback'"),
    ("loopback,members", "10.1.2.3:50070", "not allowed"),  # not a member's host
    ("10.0.0.0/8", "11.0.0.1:1", "not allowed"),
    ("*", "no-such-host.invalid:80", "does not resolve"),
])
def test_refused(allow, endpoint, why):
    with pytest.raises(EndpointRefusedError, match=why):
        EndpointPolicy.parse(allow, lambda: {"10.9.9.9"}).check(endpoint)


def test_host_globs_and_bad_patterns(monkeypatch):
    import services.reward.endpoints as endpoints

    monkeypatch.setattr(endpoints.socket, "getaddrinfo", lambda host, *a, **k: {
        "rule.verifiers.svc": [(0, 0, 0, "", ("10.4.0.7", 0))],
        "evil.verifiers.svc": [(0, 0, 0, "", ("169.254.169.254", 0))],
    }[host])
    policy = EndpointPolicy.parse("*.verifiers.svc")
    policy.check("rule.verifiers.svc:50070")
    with pytest.raises(EndpointRefusedError, match="never allowed"):
        policy.check("evil.verifiers.svc:50070")  # a name that resolves to the metadata address
    with pytest.raises(ValueError, match="not a CIDR"):
        EndpointPolicy.parse("10.0.0.0/99")
    with pytest.raises(ValueError, match="empty"):
        EndpointPolicy.parse(" , ")
    with pytest.raises(ValueError, match="host:port"):
        policy.check("rule.verifiers.svc")


def test_register_verifier_checks_the_endpoint(reward_worker):
    stub = reward_pb2_grpc.RewardStub(make_channel(reward_worker.server.address, token="s3cret"))
    for endpoint in ("169.254.169.254:80", "10.1.2.3:50070"):
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="probe", endpoint=endpoint), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, endpoint
        assert endpoint in info.value.details()
    listed = stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=10)
    assert "probe" not in [v.name for v in listed.verifiers]
