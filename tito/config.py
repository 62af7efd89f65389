"""Typed configuration shared by the services, validated at start-up.

Services extend `ServerConfig` with their own fields. Nothing here reads the environment at
import time; the CLI builds configs from its arguments and calls `validate()`, whose messages say
what a correct value looks like.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tito import security
from tito.cpu_affinity import check_cpus, parse_cpu_list
from tito.errors import ConfigError
from tito.logs import LOG_LEVELS
from tito.settings import setting

__all__ = ["ConfigError", "ServerConfig", "model_setting", "validate_address"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SECURITY = "who may call (docs/security.md)"
OBSERVABILITY = "observability (docs/metrics.md, docs/tracing.md)"
_TCP_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def validate_address(address: str, what: str = "address") -> None:
    """Accept `host:port` (port 0 = any free port), `[v6]:port`, or `unix:/path/to.sock`."""
    if address.startswith("unix:"):
        if len(address.removeprefix("unix://").removeprefix("unix:")) == 0:
            raise ConfigError(f"{what} {address!r}: a unix address needs a path, e.g. unix:/tmp/tito-render.sock")
        return
    match = _TCP_ADDRESS.match(address)
    if not match or int(match.group(2)) > 65535:
        raise ConfigError(
            f"{what} {address!r} is not valid: use host:port (e.g. 127.0.0.1:50051, port 0 for any free "
            f"port) or unix:/path/to.sock")


@dataclass
class ServerConfig:
    """What every tito server needs: where to listen, message limits, shutdown grace, logging, and
    who may call (tito.security: TLS, mutual TLS, a bearer token). Each field's flag, help and
    default are declared here once (tito.settings); `tito_cli.main` adds them to every service."""

    # Each service's command line defaults to its own port (tito_cli.main.DEFAULT_ADDRESSES).
    address: str = setting("127.0.0.1:0", common=True,
                           help="host:port (port 0 = any free port) or unix:/path/to.sock")
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, common=True,
                                     help="largest gRPC message accepted or sent")
    grace_seconds: float = setting(10.0, common=True,
                                   help="on SIGTERM, time given to in-flight calls before they are cancelled")
    log_level: str = setting("info", common=True, choices=LOG_LEVELS, help="log level")
    reuse_port: bool = False  # set by render's worker pool, not a flag
    tls_cert_file: str = setting("", common=True, group=SECURITY,
                                 help="PEM certificate: serve TLS only (with --tls-key-file)")
    tls_key_file: str = setting("", common=True, group=SECURITY, help="PEM private key of --tls-cert-file")
    tls_client_ca_file: str = setting("", common=True, group=SECURITY,
                                      help="mutual TLS: require client certificates issued by this PEM CA")
    auth_token_file: str = setting("", common=True, group=SECURITY,
                                   help="require `authorization: Bearer <token>` on every call (token read from "
                                        "the file)")
    auth_exempt_health: bool = setting(True, common=True, group=SECURITY,
                                       help="let health checks and reflection through without the token")
    # None: no metrics (nothing of prometheus_client is even imported).
    metrics_port: int | None = setting(
        None, type=int, common=True, group=OBSERVABILITY,
        help="serve Prometheus metrics at http://HOST:PORT/metrics, HOST being the --address host (127.0.0.1 "
             "for a unix socket); 0 = any free port", default_text="no metrics")
    otel: bool = setting(False, common=True, group=OBSERVABILITY,
                         help="export OpenTelemetry traces (OTLP, configured by the OTEL_* variables); also on "
                              "when OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT is set")
    cpu_affinity: str = setting("", common=True,
                                help="Linux: run this service's process on these CPUs only, e.g. 0-3,6 (keep render, "
                                     "derender and a router off the engine core's CPUs: services/engine/README.md); "
                                     "default: any", default_text="any CPU")
    # Kubernetes gRPC probes speak neither TLS nor Unix sockets; "" = none.
    health_address: str = setting("", common=True,
                                  help="also serve the gRPC health service alone, in plaintext, here (host:port): "
                                       "for probes that speak neither TLS nor Unix sockets, e.g. Kubernetes grpc "
                                       "probes")

    def validate(self) -> None:
        validate_address(self.address)
        if self.health_address:
            validate_address(self.health_address, "health_address")
            if self.health_address == self.address:
                raise ConfigError(f"--health-address {self.health_address} is --address too: give the health "
                                  f"listener a port of its own")
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ConfigError(
                f"max_message_bytes={self.max_message_bytes} must be between 1024 and 2147483647 "
                f"(default {DEFAULT_MAX_MESSAGE_BYTES})")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds={self.grace_seconds} must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port} must be a TCP port, 0-65535 (0 = any free port); "
                              f"leave --metrics-port out for no metrics")
        if self.cpu_affinity:
            check_cpus(parse_cpu_list(self.cpu_affinity), "--cpu-affinity")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r} must be one of {', '.join(LOG_LEVELS)}")
        self._validate_security()

    def _validate_security(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("TLS needs both --tls-cert-file and --tls-key-file (PEM files)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("--tls-client-ca-file (mutual TLS) needs the server's own --tls-cert-file and "
                              "--tls-key-file too")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            if getattr(self, name):
                security.read_file(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.auth_token_file:
            security.read_token_file(self.auth_token_file)


def model_setting(default: str, what: str) -> Any:
    """The `--model` field every service declares (`what`: what the service reads of it)."""
    return setting(default, common=True,
                   help=f"local Hugging Face model directory, or a built-in tiny model name ({what})")
