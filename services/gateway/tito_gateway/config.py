"""The gateway's typed configuration (extends the common ServerConfig: address, TLS, token, logs)."""

from __future__ import annotations

from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig, validate_address
from tito.lora_names import is_lora_name
from tito.security import ClientSecurity
from tito.settings import setting

UPSTREAM = "the services behind the gateway"
HTTP = "HTTP limits"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class GatewayConfig(ServerConfig):
    """Where the three services are, how to reach them, and the HTTP side's bounds.

    `address` is the HTTP listener (host:port or unix:/path). `tls_cert_file`/`tls_key_file` make it
    HTTPS (with `tls_client_ca_file`: mutual TLS); `auth_token_file` requires
    `Authorization: Bearer <token>` on every /v1 call and is also sent to the services behind."""

    render_address: str = setting("127.0.0.1:50051", group=UPSTREAM, help="render's address (host:port or unix:/path)")
    engine_address: str = setting("127.0.0.1:50052", group=UPSTREAM,
                                  help="engine address, or several separated by commas, or dns:///name:port (e.g. a "
                                       "headless Service: every address it resolves to): see --routing-policy")
    routing_policy: str = setting("cache_aware", group=UPSTREAM, choices=("cache_aware", "least_load", "round_robin"),
                                  help="with several engines (or a dns:/// target): how each request's engine is "
                                       "chosen (tito_client.routing: cache_aware = the longest cached prefix, then "
                                       "the least load)")
    migration_limit: int = setting(3, group=UPSTREAM,
                                   help="with several engines (or a dns:/// target): how many times one chat may "
                                        "move to another engine when its engine goes away mid-stream (killed, "
                                        "restarting, draining); it continues from the tokens it has, the client "
                                        "sees one stream. 0: never (the chat fails with the engine's status)")
    prefill_engines: str = setting("", group=UPSTREAM,
                                   help="prefill/decode: engine addresses (comma-separated) that only prefill: a "
                                        "prompt of at least --pd-min-prompt-tokens is prefilled on one of them and "
                                        "decoded on a --decode-engines or --engine-address engine of the same KV "
                                        "transfer protocol, which takes its KV (native engines pull it; vllm-backend "
                                        "engines through vLLM's connector)")
    decode_engines: str = setting("", group=UPSTREAM,
                                  help="prefill/decode: engine addresses (comma-separated) that only decode (and "
                                       "serve the prompts too short to prefill elsewhere); --engine-address "
                                       "engines serve both roles")
    pd_min_prompt_tokens: int = setting(256, group=UPSTREAM,
                                        help="prefill/decode: prompts shorter than this go to one engine, never to a "
                                             "--prefill-engines engine")
    derender_address: str = setting("127.0.0.1:50053", group=UPSTREAM, help="derender's address")
    derender_batch: bool = setting(True, group=UPSTREAM,
                                   help="carry every chat's derender stream over one DerenderBatch call (one "
                                        "message per engine step for all chats, not one per chat and token); "
                                        "--no-derender-batch opens a Derender call per chat")
    upstream_tls_ca_file: str = setting("", group=UPSTREAM,
                                        help="PEM CA that issued the services' certificates (TLS to them on; Unix "
                                             "sockets stay plaintext)")
    upstream_tls_server_name: str = setting("", group=UPSTREAM,
                                            help="name in the services' certificates, when it differs from the host")
    upstream_timeout: float = setting(600.0, group=UPSTREAM, help="deadline of each call to the services, seconds")
    served_model_name: str = setting("", help="the model name clients send and /v1/models lists",
                                     default_text="render's model id")
    allow_runtime_lora_updating: bool = setting(
        False, help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (each engine's "
                    "LoadLoraAdapter / UnloadLoraAdapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    lora_modules: tuple[str, ...] = setting(
        (), type=str, nargs="*", metavar="NAME=DIR", default_text="none", group=UPSTREAM,
        help="LoRA adapters the gateway may load on an engine, each NAME=DIR with DIR under the engines' "
             "--lora-dir: a chat naming one goes to an engine holding it with room, else to the least loaded "
             "engine, which loads it first (tito_client.routing); /v1/models lists them")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, group=HTTP,
                                  help="largest request body accepted (larger: 413)")
    max_concurrent_requests: int = setting(1024, group=HTTP,
                                           help="completions in flight at once (more: 429)")
    max_connections: int = setting(8192, group=HTTP, help="open HTTP connections at once (more are refused)")
    idle_timeout: float = setting(30.0, group=HTTP,
                                  help="seconds a connection may stay without a complete request before it is "
                                       "closed (slow or idle clients)")

    def engine_addresses(self) -> list[str]:
        return [part.strip() for part in self.engine_address.split(",") if part.strip()]

    def lora_paths(self) -> dict[str, str]:
        """--lora-modules as name -> directory (checked by validate)."""
        return dict(module.split("=", 1) for module in self.lora_modules)

    def role_addresses(self, role: str) -> list[str]:
        """--prefill-engines or --decode-engines as a list."""
        value = self.prefill_engines if role == "prefill" else self.decode_engines
        return [part.strip() for part in value.split(",") if part.strip()]

    def upstream_security(self) -> ClientSecurity:
        return ClientSecurity(ca_file=self.upstream_tls_ca_file, server_name=self.upstream_tls_server_name,
                              token_file=self.auth_token_file)

    def validate(self) -> None:
        super().validate()
        validate_address(self.render_address, "--render-address")
        validate_address(self.derender_address, "--derender-address")
        engines = self.engine_addresses()
        if not engines:
            raise ConfigError("--engine-address is empty: give one engine address (host:port or unix:/path), "
                              "or several separated by commas")
        if len(engines) > 1 and any(address.startswith("dns:") for address in engines):
            raise ConfigError("--engine-address: a dns:/// target stands alone (it names every engine); give "
                              "either it or a comma-separated list of host:port")
        for address in engines:
            if address.startswith("dns:"):
                validate_address(address.removeprefix("dns:").lstrip("/"), "--engine-address (after dns:///)")
            else:
                validate_address(address, "--engine-address")
        self._check_lora_modules()
        for role in ("prefill", "decode"):
            for address in self.role_addresses(role):
                validate_address(address, f"--{role}-engines")
        if self.role_addresses("prefill") and not (self.role_addresses("decode") or self.engine_addresses()):
            raise ConfigError("--prefill-engines needs engines to decode on: --decode-engines or --engine-address")
        if self.pd_min_prompt_tokens < 1:
            raise ConfigError(f"--pd-min-prompt-tokens {self.pd_min_prompt_tokens}: must be >= 1")
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit {self.migration_limit}: must be >= 0 (0: chats never move)")
        if self.metrics_port is not None:
            raise ConfigError("the gateway serves /metrics on its own --address: leave --metrics-port out")
        if self.health_address:
            raise ConfigError("the gateway serves GET /health on its own --address: leave --health-address out")
        if not 1024 <= self.max_body_bytes <= 2**31 - 1:
            raise ConfigError(f"--max-body-bytes {self.max_body_bytes} must be between 1024 and 2147483647 "
                              f"(default {DEFAULT_MAX_BODY_BYTES})")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"--max-concurrent-requests {self.max_concurrent_requests} must be at least 1")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections {self.max_connections} must be at least 1")
        if not self.idle_timeout > 0 or not self.upstream_timeout > 0:
            raise ConfigError("--idle-timeout and --upstream-timeout are seconds, > 0")
        self.upstream_security().validate()

    def _check_lora_modules(self) -> None:
        names = [module.split("=", 1)[0] for module in self.lora_modules]
        for module, name in zip(self.lora_modules, names):
            if "=" not in module or not is_lora_name(name) or not module.split("=", 1)[1]:
                raise ConfigError(f"--lora-modules {module[:200]!r} must be NAME=DIR (e.g. sql=adapters/sql; a name "
                                  f"is 1 to 128 letters, digits or ._-/:)")
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice ({' '.join(self.lora_modules)})")
