"""Who may call: TLS, mutual TLS and bearer tokens, for every tito server and client.

Server side (`ServerConfig` fields, the same flags on every service):
- `tls_cert_file` + `tls_key_file`: the server speaks TLS only (PEM files).
- `tls_client_ca_file`: mutual TLS: a client must present a certificate issued by this CA, or the
  handshake fails before any call exists.
- `auth_token_file`: every call must carry `authorization: Bearer <token>`; a missing one is
  UNAUTHENTICATED `AUTH_TOKEN_MISSING`, a wrong one UNAUTHENTICATED `AUTH_TOKEN_INVALID`, answered
  by `AuthInterceptor` before the method's handler runs (nothing of the request is done). The
  comparison is constant-time. Health and reflection stay open unless `auth_exempt_health` is off,
  so load balancers and grpcurl can probe without the secret.

Client side (`ClientSecurity`): the CA to trust (and an optional server name override), a client
certificate for mutual TLS, and the token to send, applied to every channel tito's clients open.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_status import rpc_status

from tito.errors import ConfigError
from tito.errors import Unauthenticated
from tito.grpc_errors import status_for

# Methods a token is not asked for (when auth_exempt_health is on).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MIN_TOKEN_CHARS = 16


def read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None


def read_token_file(path: str) -> str:
    """The bearer token in `path` (surrounding whitespace stripped; at least 16 characters)."""
    token = read_file(path, "--auth-token-file").decode("utf-8", "replace").strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(f"--auth-token-file {path!r} must hold one token of at least {MIN_TOKEN_CHARS} characters "
                          f"without spaces (e.g. `openssl rand -hex 32 > {path}`)")
    return token


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """TLS credentials; with `client_ca_file`, clients must present a certificate it issued."""
    key, cert = read_file(key_file, "TLS key file"), read_file(cert_file, "TLS certificate file")
    client_ca = read_file(client_ca_file, "TLS client CA file") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token before their handler runs."""

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES):
        self._expected = f"Bearer {token}".encode()
        self._open = open_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._open):
            return await continuation(handler_call_details)
        supplied = next((value for key, value in handler_call_details.invocation_metadata or ()
                         if key == "authorization"), None)
        if supplied is not None and hmac.compare_digest(str(supplied).encode(), self._expected):
            return await continuation(handler_call_details)
        if supplied is None:
            error = Unauthenticated("this server requires `authorization: Bearer <token>` metadata",
                                    reason="AUTH_TOKEN_MISSING")
        else:
            error = Unauthenticated("the bearer token is not this server's", reason="AUTH_TOKEN_INVALID")
        handler = await continuation(handler_call_details)
        return _refusing(handler, error) if handler is not None else None


def _refusing(handler: grpc.RpcMethodHandler, error: Unauthenticated) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers `error`."""
    status = rpc_status.to_status(status_for(error))

    async def refuse(_request, context):
        await context.abort_with_status(status)

    kinds: dict[str, Callable] = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for attr, factory in kinds.items():
        if getattr(handler, attr) is not None:
            # Raw bytes in: the request is never even parsed.
            return factory(refuse, request_deserializer=None, response_serializer=handler.response_serializer)
    return handler


@dataclass(frozen=True)
class ClientSecurity:
    """How a tito client reaches secured servers; the default is plaintext without a token."""

    ca_file: str = ""  # trust servers whose certificate this CA issued (TLS on)
    cert_file: str = ""  # a client certificate, for servers that require mutual TLS
    key_file: str = ""
    server_name: str = ""  # expected name in the server's certificate, when it differs from the address
    token_file: str = ""  # send `authorization: Bearer <token>` with every call

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("a client certificate needs both --tls-cert-file and --tls-key-file")
        if self.cert_file and not self.ca_file:
            raise ConfigError("--tls-cert-file (mutual TLS) needs --tls-ca-file, the CA to trust the server with")
        if self.token_file:
            read_token_file(self.token_file)

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A synchronous channel to `address` with this security (TLS and/or token)."""
        options = list(options or [])
        credentials = self._credentials(options)
        if credentials is not None:
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token_file:
            channel = grpc.intercept_channel(channel, _TokenInterceptor(read_token_file(self.token_file)))
        return channel

    def aio_channel(self, address: str, options: list | None = None) -> grpc.aio.Channel:
        """An asyncio channel to `address` with this security's TLS; its calls carry the token
        when given `call_metadata()` (asyncio channels take no channel-wide metadata)."""
        options = list(options or [])
        credentials = self._credentials(options)
        if credentials is not None:
            return grpc.aio.secure_channel(address, credentials, options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def call_metadata(self) -> list[tuple[str, str]]:
        """The metadata every call sends: the bearer token, when there is one."""
        return [("authorization", f"Bearer {read_token_file(self.token_file)}")] if self.token_file else []

    def _credentials(self, options: list) -> grpc.ChannelCredentials | None:
        """TLS credentials (adding the name override to `options`), or None for plaintext."""
        if not self.ca_file:
            return None
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.ssl_channel_credentials(
            root_certificates=read_file(self.ca_file, "TLS CA file"),
            private_key=read_file(self.key_file, "TLS key file") if self.key_file else None,
            certificate_chain=read_file(self.cert_file, "TLS certificate file") if self.cert_file else None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call (also over plaintext, e.g. a sidecar's Unix socket)."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return _Details(details, self._header)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


class _Details(grpc.ClientCallDetails):
    """`details` with one more metadata entry."""

    def __init__(self, details, header):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = [*(details.metadata or ()), header]
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
