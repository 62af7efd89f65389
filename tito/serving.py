"""Server bootstrap shared by the three services (the grpc examples' idioms, in one place).

`start_server` builds a `grpc.aio` server with the error-mapping interceptor, message size
limits, the standard health service (NOT_SERVING until the service says it is ready), server
reflection (grpc.reflection.v1 and v1alpha: tito.reflection), and binds a TCP `host:port` (port 0
picks a free one) or a `unix:` socket, with TLS (and mutual TLS) and a bearer-token check when
configured (tito.security).
With `--metrics-port` or tracing on, an `ObservingInterceptor` (tito.grpc_observe) wraps every
call first, and the server's /metrics endpoint starts and stops with it (`observability`).
With `health_address` a second, plaintext listener serves the same health status and nothing else
(Kubernetes gRPC probes speak neither TLS nor Unix sockets).
`run_until_signal` serves until SIGTERM/SIGINT, then enters graceful shutdown (a service's
drainer first, e.g. the engine's Drain; then health turns NOT_SERVING, new calls are refused) and
gives in-flight calls `grace_seconds` to finish; before serving it moves the start-up heap out of
the garbage collector's reach (`freeze_startup_heap`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tito import reflection
from tito import tracing
from tito.config import ConfigError, ServerConfig
from tito.grpc_errors import ErrorMappingInterceptor, method_prefixes
from tito.security import OPEN_METHOD_PREFIXES, AuthInterceptor, read_token_file, server_credentials
from tito.startup import freeze_startup_heap

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started server: the grpc server, the address clients should dial, its health servicer."""

    server: grpc.aio.Server
    address: str
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    grace_seconds: float
    cleanups: list[Callable[[], object]] = field(default_factory=list)
    metrics: Any = None  # tito.metrics.ServiceMetrics when serving /metrics (its .address: host:port)
    # Other endpoints the service listens on, by name (e.g. the engine's "kv_events" ZMQ address).
    endpoints: dict[str, str] = field(default_factory=dict)
    # Run when shutdown begins, before in-flight calls are waited for (e.g. ending endless streams).
    closers: list[Callable[[], object]] = field(default_factory=list)
    # Run first when shutdown begins, with the grace seconds: a service's own way to hand its work
    # over before calls are refused (the engine drains: routers move its chats elsewhere).
    drainers: list[Callable[[float], Awaitable[object]]] = field(default_factory=list)

    def add_drainer(self, drainer: Callable[[float], Awaitable[object]]) -> None:
        """Await `drainer(grace_seconds)` as shutdown begins, before anything else."""
        self.drainers.append(drainer)

    def add_closer(self, closer: Callable[[], object]) -> None:
        """Run `closer` (sync) as shutdown begins, so calls that never end by themselves (event
        subscriptions) end now instead of holding the grace period."""
        self.closers.append(closer)

    def add_cleanup(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` (sync or async) after the server has stopped, e.g. to free a model."""
        self.cleanups.append(cleanup)

    async def set_serving(self) -> None:
        """Mark every service (and the whole server, "") SERVING."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Mark every service NOT_SERVING (e.g. the model died): load balancers stop sending work."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: drain, health NOT_SERVING, refuse new calls, let in-flight ones finish."""
        grace_seconds = self.grace_seconds if grace is None else grace
        for drainer in self.drainers:
            await drainer(grace_seconds)
        await self.health.enter_graceful_shutdown()
        for closer in self.closers:
            closer()
        await self.server.stop(self.grace_seconds if grace is None else grace)
        for cleanup in reversed(self.cleanups):
            result = cleanup()
            if asyncio.iscoroutine(result):
                await result
        self.cleanups.clear()


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if config.reuse_port else 0),
    ]


def observability(config: ServerConfig, service: str) -> Any:
    """Turn tracing on when the config or the OTEL_* variables ask (tito.tracing), and build the
    server's metrics when it has a metrics port: a tito.metrics.ServiceMetrics to add the service's
    own series to and pass to `start_server`, or None."""
    tracing.configure(service, config.otel)
    if config.metrics_port is None:
        return None
    from tito.metrics import ServiceMetrics

    return ServiceMetrics(service)


async def start_server(
    config: ServerConfig,
    service_names: Iterable[str],
    register: Callable[[grpc.aio.Server], None],
    metrics: Any = None,
) -> RunningServer:
    """Create, bind and start a server; health stays NOT_SERVING until `set_serving()`.

    `metrics` (from `observability`): served on config.metrics_port while the server runs."""
    config.validate()
    names = tuple(service_names)
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if metrics is not None or tracing.enabled():  # first: it sees every call's final status
        from tito.grpc_observe import ObservingInterceptor

        interceptors.append(ObservingInterceptor(metrics))
    if config.auth_token_file:  # first: an unauthenticated call goes no further
        open_prefixes = OPEN_METHOD_PREFIXES if config.auth_exempt_health else ()
        interceptors.append(AuthInterceptor(read_token_file(config.auth_token_file), open_prefixes))
    interceptors.append(ErrorMappingInterceptor(method_prefixes(names)))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME), server)
    address = config.address
    check_can_listen(address, config.reuse_port)  # before grpc tries: its own failure logs a C-core line
    credentials = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) \
        if config.tls_cert_file else None

    def bind(where: str) -> int:
        try:
            port = server.add_secure_port(where, credentials) if credentials else server.add_insecure_port(where)
        except RuntimeError:  # grpc's "Failed to bind to address"
            port = 0
        if port == 0 and not where.startswith("unix:"):
            raise ConfigError(_cannot_listen(where))
        return port

    if address.startswith("unix:"):
        path = address.removeprefix("unix://").removeprefix("unix:")
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a previous run would make the bind fail
        if not bind(address):
            raise ConfigError(f"--address {address}: cannot create the socket (does its directory exist and is "
                              f"it writable?)")
        dial = address
    else:
        port = bind(address)
        host = address.rsplit(":", 1)[0]
        dial = f"{host}:{port}"
    health_only = await _start_health_listener(config, health_servicer) if config.health_address else None
    await server.start()
    running = RunningServer(server, dial, health_servicer, names, config.grace_seconds, metrics=metrics)
    if metrics is not None:
        from tito.metrics import metrics_host

        try:
            metrics.serve(metrics_host(address), config.metrics_port)
        except ConfigError:
            await server.stop(0)
            raise
        running.add_cleanup(lambda: asyncio.to_thread(metrics.stop))  # waits out the HTTP poll loop
    security = ", ".join(part for part, on in (("TLS", credentials), ("mutual TLS", config.tls_client_ca_file),
                                               ("bearer token", config.auth_token_file)) if on) or "plaintext"
    log.info("listening on %s (services: %s; %s)", dial, ", ".join(names), security)
    if health_only is not None:
        running.add_cleanup(lambda: health_only.stop(0))
    return running


async def _start_health_listener(config: ServerConfig, health_servicer) -> grpc.aio.Server:
    """A plaintext server with only the health service (the same servicer: one status for both)."""
    check_can_listen(config.health_address, config.reuse_port, "--health-address")
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if config.reuse_port else 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(config.health_address)
    except RuntimeError:
        port = 0
    if port == 0 and not config.health_address.startswith("unix:"):
        raise ConfigError(_cannot_listen(config.health_address, "--health-address"))
    await server.start()
    log.info("health service (plaintext, nothing else) on %s", config.health_address)
    return server


def _cannot_listen(address: str, flag: str = "--address") -> str:
    return (f"{flag} {address}: cannot listen there (the port is in use, or the host is not this machine's); "
            f"pick another port (0 = any free one) or stop what listens there")


def check_can_listen(address: str, reuse_port: bool = False, flag: str = "--address") -> None:
    """ConfigError when a TCP `address` cannot be bound now (port taken, foreign host), for
    supervisors that start servers in other processes and should fail with one line instead.
    Unix sockets and port 0 always pass (start_server reports their failures)."""
    if address.startswith("unix:"):
        return
    host, port = address.rsplit(":", 1)
    if int(port) == 0:
        return
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no obstacle
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            raise ConfigError(_cannot_listen(address, flag)) from None


async def run_until_signal(running: RunningServer) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    log.debug("%d start-up objects frozen out of garbage collection", freeze_startup_heap())
    loop = asyncio.get_running_loop()
    stop_event = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    await stop_event.wait()
    log.info("shutting down: finishing in-flight calls (grace %.1fs)", running.grace_seconds)
    await running.stop()
    tracing.shutdown()  # export the spans still buffered
    log.info("stopped")
