"""Gateway server: CLI flags, the HTTP listener (uvicorn with httptools) and the entry point.

The listener guards its connections (`GuardedProtocol`): a connection must complete its request
headers within --idle-timeout of opening (or of its previous response), and send at most
MAX_HEADER_BYTES before they are complete, or it is closed; beyond --max-connections open at once,
new ones are closed at once. So slow or idle clients hold a bounded share of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import ssl
from dataclasses import dataclass, field

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tito import settings, tracing
from tito.config import ConfigError
from tito.security import read_token_file
from tito.serving import check_can_listen
from tito.settings import add_settings
from tito.startup import StartupPhases, freeze_startup_heap
from tito_gateway.app import Gateway
from tito_gateway.config import GatewayConfig
from tito_gateway.upstream import Upstream

log = logging.getLogger(__name__)

#: The typed config whose field declarations give this service's flags (tito.settings).
CONFIG = GatewayConfig
#: Bytes a connection may send before its request headers are complete.
MAX_HEADER_BYTES = 64 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, GatewayConfig, common=False)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    config = settings.config_from_args(GatewayConfig, args)
    config.validate()
    return config


def set_no_delay(transport) -> None:
    """Send each SSE event at once (TCP_NODELAY). asyncio's own loop sets it only on sockets whose
    `proto` is IPPROTO_TCP, which an accepted socket of a listener made with proto 0 is not; with
    Nagle on, an event written while the previous one is unacknowledged waits for the client's
    delayed ACK: measured ~40 ms between the response headers and the first event (TTFT 65-72 ms
    through the gateway against 18 ms through the pipeline directly)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines and bounds for clients that do not send."""

    idle_timeout = 30.0
    max_connections = 8192

    def connection_made(self, transport) -> None:  # type: ignore[override]
        set_no_delay(transport)
        super().connection_made(transport)
        self._header_bytes = 0
        self._in_request = False
        self._deadline = None
        if len(self.connections) > self.max_connections:
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.idle_timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self._in_request and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._in_request:
            self._header_bytes += len(data)
        super().data_received(data)
        # Still no complete headers after this data (bytes that completed them and went on into
        # the body do not count): past the bound, the connection is refused.
        if not self._in_request and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                 b"content-length: 0\r\n\r\n")
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_request = True
        self._header_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._in_request = False
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


@dataclass
class RunningGateway:
    """A started gateway: its HTTP address, the uvicorn server and the app state."""

    address: str
    server: uvicorn.Server
    gateway: Gateway
    upstream: Upstream
    task: asyncio.Task
    sockets: list = field(default_factory=list)

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=30)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()
        await self.upstream.close()


def _listen(address: str) -> tuple[socket.socket, str]:
    """A listening socket for `address` (host:port, port 0 = any free one, or unix:/path) and the
    address it got."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix://").removeprefix("unix:")
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        bound = f"unix:{path}"
    else:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        got = sock.getsockname()[1]
        bound = f"[{host}]:{got}" if family == socket.AF_INET6 else f"{host}:{got}"
    sock.listen(4096)
    sock.setblocking(False)
    return sock, bound


async def create_server(config: GatewayConfig, phases: StartupPhases | None = None) -> RunningGateway:
    """Bind and start serving HTTP; the services behind are reached per request (GET /health says
    whether they are all SERVING), so the gateway may start before them."""
    phases = phases or StartupPhases()
    config.validate()
    tracing.configure("gateway", config.otel)
    check_can_listen(config.address)
    token = read_token_file(config.auth_token_file) if config.auth_token_file else ""
    upstream = Upstream(config.render_address, config.engine_addresses(), config.derender_address,
                        config.upstream_timeout, config.upstream_security(), config.max_message_bytes,
                        config.routing_policy, batch_derender=config.derender_batch,
                        migration_limit=config.migration_limit, lora_paths=config.lora_paths(),
                        roles=(config.role_addresses("prefill"), config.role_addresses("decode"),
                               config.pd_min_prompt_tokens))
    gateway = Gateway(upstream, served_model_name=config.served_model_name, token=token,
                      lora_updating=config.allow_runtime_lora_updating,
                      auth_exempt_health=config.auth_exempt_health, max_body_bytes=config.max_body_bytes,
                      max_concurrent_requests=config.max_concurrent_requests, body_timeout=config.idle_timeout)
    protocol = type("Guarded", (GuardedProtocol,), {"idle_timeout": config.idle_timeout,
                                                     "max_connections": config.max_connections})
    tls: dict = {}
    if config.tls_cert_file:
        tls = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
        if config.tls_client_ca_file:
            tls.update(ssl_ca_certs=config.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    uv_config = uvicorn.Config(gateway.asgi(), http=protocol, lifespan="off", log_level="warning",
                               access_log=False, timeout_keep_alive=int(max(1, config.idle_timeout)),
                               timeout_graceful_shutdown=int(config.grace_seconds), **tls)
    server = uvicorn.Server(uv_config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # run_until_signal's
    with phases.phase("bind"):
        try:
            sock, bound = _listen(config.address)
        except OSError as exc:
            raise ConfigError(f"--address {config.address}: cannot listen: {exc.strerror or exc}") from None
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
                raise ConfigError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.01)
    scheme = "https" if config.tls_cert_file else "http"
    log.info("gateway listening on %s://%s; render %s, engine %s, derender %s", scheme, bound,
             config.render_address, config.engine_address, config.derender_address)
    phases.serving()
    return RunningGateway(bound, server, gateway, upstream, task, [sock])


async def serve(config: GatewayConfig, phases: StartupPhases | None = None) -> None:
    running = await create_server(config, phases)
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await asyncio.wait((asyncio.ensure_future(stop.wait()), running.task), return_when=asyncio.FIRST_COMPLETED)
    await running.stop()
