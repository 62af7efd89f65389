"""Who may call: TLS, mutual TLS and bearer tokens on real servers, with tito's own clients."""

from __future__ import annotations

import asyncio

import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tito.config import ConfigError
from tito.grpc_errors import error_details
from tito_client.pipeline import AsyncChatPipeline, ChatPipeline, Endpoints
from tito.security import ClientSecurity
from tito.v1 import chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, engine_pb2_grpc, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TIMEOUT = 30
TOKEN = "a" * 40


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def _issue(common_name: str, issuer_cert, issuer_key, *, ca: bool = False, san: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(issuer_cert.subject if issuer_cert is not None else _name(common_name))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost, a client certificate, and a stranger's client certificate."""
    root = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = _issue("tito test CA", None, None, ca=True)
    other_ca_cert, other_ca_key = _issue("another CA", None, None, ca=True)
    files = {"ca": _write(root / "ca", ca_cert, ca_key)[0]}
    files["server_cert"], files["server_key"] = _write(root / "server", *_issue("localhost", ca_cert, ca_key, san=True))
    files["client_cert"], files["client_key"] = _write(root / "client", *_issue("router", ca_cert, ca_key))
    files["stranger_cert"], files["stranger_key"] = _write(root / "stranger",
                                                           *_issue("stranger", other_ca_cert, other_ca_key))
    (root / "token").write_text(TOKEN + "\n")
    files["token"] = str(root / "token")
    (root / "wrong-token").write_text("b" * 40)
    files["wrong_token"] = str(root / "wrong-token")
    return files


def _localhost(address: str) -> str:
    return "localhost:" + address.rsplit(":", 1)[1]  # the name in the server's certificate


def _detokenize(channel: grpc.Channel) -> str:
    return derender_pb2_grpc.DerenderServiceStub(channel).Detokenize(
        derender_pb2.DetokenizeRequest(token_ids=[882, 11]), timeout=TIMEOUT).text


def test_tls_serves_tls_clients_only(aio_server, tiny_text_model, pki):
    server = aio_server(lambda: create_derender(DerenderConfig(
        address="127.0.0.1:0", model=str(tiny_text_model), tls_cert_file=pki["server_cert"],
        tls_key_file=pki["server_key"])))
    address = _localhost(server.address)
    with ClientSecurity(ca_file=pki["ca"]).channel(address) as channel:
        assert _detokenize(channel)
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as exc:
        _detokenize(channel)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_ca(aio_server, tiny_text_model, pki):
    server = aio_server(lambda: create_derender(DerenderConfig(
        address="127.0.0.1:0", model=str(tiny_text_model), tls_cert_file=pki["server_cert"],
        tls_key_file=pki["server_key"], tls_client_ca_file=pki["ca"])))
    address = _localhost(server.address)
    with ClientSecurity(ca_file=pki["ca"], cert_file=pki["client_cert"], key_file=pki["client_key"]).channel(
            address) as channel:
        assert _detokenize(channel)
    for security in (ClientSecurity(ca_file=pki["ca"]),
                     ClientSecurity(ca_file=pki["ca"], cert_file=pki["stranger_cert"], key_file=pki["stranger_key"])):
        with security.channel(address) as channel, pytest.raises(grpc.RpcError) as exc:
            _detokenize(channel)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_bearer_token_is_checked_before_any_work(aio_server, tiny_text_model, pki):
    server = aio_server(lambda: create_engine(EngineConfig(
        address="127.0.0.1:0", model=str(tiny_text_model), device="cpu", engine_process=False,
        auth_token_file=pki["token"])))
    good = engine_pb2.GenerateRequest(token_ids=[5, 6], sampling_params={"max_tokens": 2, "temperature": 0})
    authorized = ClientSecurity(token_file=pki["token"])
    for security, reason in ((ClientSecurity(), "AUTH_TOKEN_MISSING"),
                             (ClientSecurity(token_file=pki["wrong_token"]), "AUTH_TOKEN_INVALID")):
        with security.channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                list(engine_pb2_grpc.EngineServiceStub(channel).Generate(good, timeout=TIMEOUT))
            details = error_details(exc.value)
            assert (details["code"], details["reason"]) == (grpc.StatusCode.UNAUTHENTICATED, reason)
            # KV events carry other callers' prompt tokens: the same token guards them.
            with pytest.raises(grpc.RpcError) as exc:
                next(engine_pb2_grpc.EngineServiceStub(channel).SubscribeKvEvents(
                    engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT))
            assert error_details(exc.value)["reason"] == reason
            # Health stays open to load balancers (auth_exempt_health, the default).
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with authorized.channel(server.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
        assert load.finished_requests == 0  # the refused calls never reached the engine
        assert list(stub.Generate(good, timeout=TIMEOUT))[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


def test_health_can_require_the_token_too(aio_server, tiny_text_model, pki):
    server = aio_server(lambda: create_derender(DerenderConfig(
        address="127.0.0.1:0", model=str(tiny_text_model), auth_token_file=pki["token"], auth_exempt_health=False)))
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as exc:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_chat_through_three_services_with_tls_and_a_token(aio_server, tiny_text_model, pki):
    secured = dict(address="127.0.0.1:0", model=str(tiny_text_model), tls_cert_file=pki["server_cert"],
                   tls_key_file=pki["server_key"], auth_token_file=pki["token"])
    servers = [aio_server(lambda: create_render(RenderConfig(**secured))),
               aio_server(lambda: create_engine(EngineConfig(device="cpu", engine_process=False, **secured))),
               aio_server(lambda: create_derender(DerenderConfig(**secured)))]
    endpoints = Endpoints(*(_localhost(server.address) for server in servers))
    security = ClientSecurity(ca_file=pki["ca"], token_file=pki["token"])
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="Hello")],
                                           sampling=render_pb2.SamplingOptions(max_tokens=6, temperature=0.0))
    with ChatPipeline(endpoints, timeout=60, security=security) as pipeline:
        chunks = list(pipeline.stream_chat(request))
    assert chunks[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED

    async def async_chat(security: ClientSecurity) -> list:
        async with AsyncChatPipeline(endpoints, timeout=60, security=security) as pipeline:
            return [chunk async for chunk in pipeline.stream_chat(request)]

    def text(chunks: list) -> str:  # how tokens group into chunks depends on timing; the text does not
        return "".join(chunk.reasoning_content + chunk.content for chunk in chunks)

    async_chunks = asyncio.run(async_chat(security))  # TLS, and the token on each call
    assert text(async_chunks) == text(chunks) and async_chunks[-1].usage == chunks[-1].usage
    with pytest.raises(grpc.RpcError) as exc:
        asyncio.run(async_chat(ClientSecurity(ca_file=pki["ca"])))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("fields, message", [
    ({"tls_cert_file": "x.pem"}, "both --tls-cert-file and --tls-key-file"),
    ({"tls_client_ca_file": "ca.pem"}, "needs the server's own --tls-cert-file"),
    ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "/nonexistent.key"}, "cannot be read"),
])
def test_security_settings_are_checked_at_start_up(fields, message):
    with pytest.raises(ConfigError, match=message):
        DerenderConfig(**fields).validate()


def test_a_short_token_is_refused(tmp_path):
    (tmp_path / "token").write_text("short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        DerenderConfig(auth_token_file=str(tmp_path / "token")).validate()
