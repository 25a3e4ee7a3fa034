"""A real server on loopback: reflection lists its services, health says SERVING, metrics answer, auth guards."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfabric.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import make_channel
from services.common.server import ServiceServer, ServiceSpec, create_server
from services.common.status import echo

TOKEN = "s3cret"


class EchoReward(reward_pb2_grpc.RewardServicer):
    """A minimal servicer: enough to exercise the bootstrap, not the reward logic."""

    def ListVerifiers(self, request, context):
        return reward_pb2.ListVerifiersResponse(verifiers=[reward_pb2.VerifierInfo(name="echo")])

    def RegisterVerifier(self, request, context):
        return reward_pb2.RegisterVerifierResponse(verifier=reward_pb2.VerifierInfo(name=request.name))


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceServer]:
    srv = create_server(
        [ServiceSpec(reward_pb2_grpc.add_RewardServicer_to_server, EchoReward(), "rlfabric.v1.Reward")],
        component="test",
        auth_token=TOKEN,
        auth_methods={"/rlfabric.v1.Reward/RegisterVerifier"},
    ).start()
    yield srv
    srv.stop(0)


def test_reflection_lists_services(server: ServiceServer) -> None:
    with make_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"rlfabric.v1.Reward", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_health_is_serving(server: ServiceServer) -> None:
    with make_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "rlfabric.v1.Reward"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_endpoint_answers(server: ServiceServer) -> None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert "python_info" in body or "process_" in body


def test_token_guards_only_listed_methods(server: ServiceServer) -> None:
    with make_channel(server.address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        assert stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=5).verifiers[0].name == "echo"
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with make_channel(server.address, token="wrong") as channel:
        with pytest.raises(grpc.RpcError) as err:
            reward_pb2_grpc.RewardStub(channel).RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with make_channel(server.address, token=TOKEN) as channel:
        reply = reward_pb2_grpc.RewardStub(channel).RegisterVerifier(reward_pb2.RegisterVerifierRequest(name="x"), timeout=5)
        assert reply.verifier.name == "x"


def test_a_refusal_quotes_the_called_method_cut_short() -> None:
    # With every method guarded, the refused path is whatever the client sent: echoed, so a long one cannot push
    # the status past the client's metadata limit (services/common/status.py).
    srv = create_server([], component="guard-all", metrics_port=None, auth_token=TOKEN, auth_methods=None).start()
    method = "/rlfabric.v1.Nowhere/" + "x" * 5_000  # under gRPC's own 16 KiB limit on a request's path
    try:
        with make_channel(srv.address, token=None) as channel:
            call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as err:
                call(b"", timeout=5)
    finally:
        srv.stop(0)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    details = err.value.details()
    assert details == f"{echo(method)} requires 'authorization: Bearer <token>' metadata with the server's token"
    assert len(details) < 300


def test_stop_turns_health_not_serving() -> None:
    srv = create_server([], component="short", metrics_port=None).start()
    channel = make_channel(srv.address)
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    srv.set_serving(False)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    srv.stop(0)
    channel.close()


def _self_signed(tmp_path) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_with_token_call_credentials(tmp_path) -> None:
    from services.common.server import TlsConfig

    cert, key = _self_signed(tmp_path)
    srv = create_server(
        [ServiceSpec(reward_pb2_grpc.add_RewardServicer_to_server, EchoReward(), "rlfabric.v1.Reward")],
        "localhost:0", component="tls", metrics_port=None, auth_token=TOKEN, auth_methods=None,
        tls=TlsConfig(cert, key),
    ).start()
    try:
        target = f"localhost:{srv.port}"
        with make_channel(target, tls_ca=cert, token=TOKEN) as channel:
            reply = reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=5)
            assert reply.verifiers[0].name == "echo"
        with make_channel(target, tls_ca=cert) as channel:  # TLS but no token: every method is guarded here
            with pytest.raises(grpc.RpcError) as err:
                reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(target) as channel:  # plaintext against a TLS server never connects
            with pytest.raises(grpc.RpcError) as err:
                reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=2)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        srv.stop(0)
