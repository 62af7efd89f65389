"""The gateway's config: mistakes are refused at start-up with messages that say what to do."""

from __future__ import annotations

import asyncio

import pytest

from tito.config import ConfigError
from tito.security import ClientSecurity
from tito_gateway.config import GatewayConfig
from tito_gateway.upstream import Upstream


def test_defaults_validate():
    GatewayConfig().validate()


@pytest.mark.parametrize("fields, words", [
    ({"engine_address": ""}, "--engine-address is empty"),
    ({"engine_address": "a:1,dns:///b:2"}, "stands alone"),
    ({"engine_address": "dns:///"}, "--engine-address"),
    ({"engine_address": "nohostport"}, "--engine-address"),
    ({"metrics_port": 9100}, "/metrics on its own --address"),
    ({"health_address": "127.0.0.1:9"}, "GET /health"),
    ({"max_body_bytes": 10}, "--max-body-bytes"),
    ({"max_concurrent_requests": 0}, "--max-concurrent-requests"),
    ({"idle_timeout": 0}, "--idle-timeout"),
    ({"migration_limit": -1}, "--migration-limit"),
    ({"lora_modules": ("sql",)}, "must be NAME=DIR"),
    ({"lora_modules": ("bad name=dir",)}, "must be NAME=DIR"),
    ({"lora_modules": ("sql=a", "sql=b")}, "names an adapter twice"),
    ({"prefill_engines": "nohostport"}, "--prefill-engines"),
    ({"decode_engines": "10.0.0.1:1,nohostport"}, "--decode-engines"),
    ({"pd_min_prompt_tokens": 0}, "--pd-min-prompt-tokens"),
])
def test_mistakes_are_refused_by_name(fields, words):
    with pytest.raises(ConfigError) as info:
        GatewayConfig(**fields).validate()
    assert words in str(info.value)


def test_engine_targets():
    config = GatewayConfig(engine_address="10.0.0.1:50052, 10.0.0.2:50052")
    config.validate()
    assert config.engine_addresses() == ["10.0.0.1:50052", "10.0.0.2:50052"]
    GatewayConfig(engine_address="dns:///tito-engine:50052").validate()


def test_the_migration_limit_reaches_the_router():
    async def main():
        upstream = Upstream("127.0.0.1:1", ["127.0.0.1:2", "127.0.0.1:3"], "127.0.0.1:4", 1.0, ClientSecurity(),
                            1 << 20, migration_limit=5)
        try:
            return upstream.router.migration_limit
        finally:
            await upstream.close()

    assert asyncio.run(main()) == 5


def test_lora_modules_route_even_one_engine_and_are_listed_as_adapters():
    """With adapters the gateway may load, one engine is behind a router too (the router loads
    them), and the adapters are listed before any engine holds them."""
    config = GatewayConfig(lora_modules=("sql=adapters/sql",))
    config.validate()

    async def main():
        upstream = Upstream("127.0.0.1:1", ["127.0.0.1:2"], "127.0.0.1:4", 1.0, ClientSecurity(), 1 << 20,
                            lora_paths=config.lora_paths())
        try:
            return upstream.router.lora_paths, [(a.name, a.path) for a in await upstream.lora_adapters()]
        finally:
            await upstream.close()

    assert asyncio.run(main()) == ({"sql": "adapters/sql"}, [("sql", "adapters/sql")])


def test_engine_roles_reach_the_router():
    async def main():
        upstream = Upstream("127.0.0.1:1", ["127.0.0.1:2"], "127.0.0.1:4", 1.0, ClientSecurity(), 1 << 20,
                            roles=(["127.0.0.1:5"], ["127.0.0.1:6"], 64))
        try:
            router = upstream.router  # one mixed engine and two with roles: routed
            return sorted(router.addresses()), router.pd_min_prompt_tokens
        finally:
            await upstream.close()

    assert asyncio.run(main()) == (["127.0.0.1:2", "127.0.0.1:5", "127.0.0.1:6"], 64)
