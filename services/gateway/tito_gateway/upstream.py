"""The services behind the gateway: one AsyncChatPipeline, and with several engines (a list, or a
`dns:///name:port` target such as a headless Service) tito_client's `EngineRouter` choosing the
engine of each request: cache-aware by default (the engine that holds the longest prefix of the
rendered tokens, from every engine's KV events), or least_load / round_robin. A chat whose engine
goes away mid-stream continues on another (request migration, up to --migration-limit moves)."""

from __future__ import annotations

import asyncio

import grpc

from tito.security import ClientSecurity
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_client.pipeline import AsyncChatPipeline, Endpoints
from tito_client.routing import EngineRouter, NoEngineAvailable


class Upstream:
    """The pipeline and, for several engines, its router; use inside a running event loop."""

    def __init__(self, render: str, engines: list[str], derender: str, timeout: float,
                 security: ClientSecurity, max_message_bytes: int, policy: str = "cache_aware",
                 batch_derender: bool = True, migration_limit: int = 3, lora_paths: dict[str, str] | None = None,
                 roles: tuple[list[str], list[str], int] = ([], [], 256)):
        """`security`: TLS and token for every TCP address; Unix sockets (sidecars in the same pod)
        are reached in plaintext, with the token. `batch_derender`: the chats' derender streams
        share one DerenderBatch call (AsyncChatPipeline). `migration_limit`: the router's moves of
        one chat whose engine went away (tito_client.migration). `lora_paths`: the adapters the
        router may load on an engine (name -> directory under the engines' --lora-dir); with them,
        one engine is routed too (the router loads them). `roles`: prefill-only and decode-only
        engine addresses and the shortest prompt that is disaggregated (tito_client.routing)."""
        self.addresses = list(engines)
        self._timeout = timeout
        plain = ClientSecurity(token_file=security.token_file)
        sidecars = plain if render.startswith("unix:") and derender.startswith("unix:") else security
        engine_security = plain if len(engines) == 1 and engines[0].startswith("unix:") else security
        self._engine_security = engine_security
        self.lora_paths = dict(lora_paths or {})
        prefill_engines, decode_engines, pd_min_prompt_tokens = roles
        routed = (len(engines) > 1 or engines[0].startswith("dns:") or bool(self.lora_paths)
                  or bool(prefill_engines or decode_engines))
        self.router = EngineRouter(engines if len(engines) > 1 else engines[0], policy=policy,
                                   security=engine_security, migration_limit=migration_limit,
                                   lora_paths=self.lora_paths, prefill_engines=prefill_engines,
                                   decode_engines=decode_engines,
                                   pd_min_prompt_tokens=pd_min_prompt_tokens).start() if routed else None
        self.pipeline = AsyncChatPipeline(Endpoints(render, engines[0], derender), timeout=timeout,
                                          max_message_bytes=max_message_bytes, security=engine_security,
                                          router=self.router, sidecar_security=sidecars,
                                          batch_derender=batch_derender)

    async def close(self) -> None:
        await self.pipeline.close()
        if self.router is not None:
            self.router.close()

    async def lora_adapters(self) -> list[engine_pb2.LoraAdapterInfo]:
        """The LoRA adapters behind the gateway: with a router, those its engines reported at their
        last GetLoad (by name) and those it may load (with their directory); else the engine's
        ListLoraAdapters (none when it cannot say)."""
        if self.router is not None:
            names = sorted(set(self.router.adapters()) | set(self.lora_paths))
            return [engine_pb2.LoraAdapterInfo(name=name, path=self.lora_paths.get(name, "")) for name in names]
        pipeline = self.pipeline
        try:
            response = await pipeline.engine.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=10.0,
                                                              metadata=pipeline._metadata)
        except grpc.RpcError:  # an older engine, or one not serving yet: no adapters to offer
            return []
        return list(response.adapters)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """LoadLoraAdapter on every engine (the first refusal is raised)."""
        request = engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        await self._every_engine(lambda stub: stub.LoadLoraAdapter(request, timeout=self._timeout,
                                                                   metadata=self.pipeline._metadata))

    async def unload_lora_adapter(self, name: str) -> None:
        """UnloadLoraAdapter on every engine."""
        request = engine_pb2.UnloadLoraAdapterRequest(lora_name=name)
        await self._every_engine(lambda stub: stub.UnloadLoraAdapter(request, timeout=self._timeout,
                                                                     metadata=self.pipeline._metadata))

    async def _every_engine(self, call) -> None:
        if self.router is None:
            await call(self.pipeline.engine)
            return
        try:
            for address in self.router.addresses():
                async with self._engine_security.aio_channel(address) as channel:
                    await call(engine_pb2_grpc.EngineServiceStub(channel))
        finally:  # the router's view of who holds which adapter, current for the next request
            await asyncio.to_thread(self.router.poll_loads)

    async def health(self) -> dict[str, str]:
        """Each service's health: render, engine, derender (with a router, the engine is SERVING
        while the router knows a reachable engine)."""
        states = await self.pipeline.check_health()
        if self.router is not None:
            try:
                self.router.pick(engine_pb2.GenerateRequest())
                states["engine"] = "SERVING"
            except NoEngineAvailable:
                states["engine"] = "NOT_SERVING"
        return states
