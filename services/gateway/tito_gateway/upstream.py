"""The services behind the gateway: one AsyncChatPipeline per engine (render and derender shared
by address), and the choice of engine for each request: the one with the fewest requests in flight
from this gateway (ties in turn). Cache-aware routing (prefix KV and encoder outputs) plugs in here."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tito.security import ClientSecurity
from tito_client.pipeline import AsyncChatPipeline, Endpoints


class Upstream:
    """The pipelines, by engine; use inside a running event loop."""

    def __init__(self, render: str, engines: list[str], derender: str, timeout: float,
                 security: ClientSecurity, max_message_bytes: int):
        """`security`: TLS and token for every TCP address; Unix sockets (sidecars in the same pod)
        are reached in plaintext, with the token."""
        self.addresses = list(engines)
        plain = ClientSecurity(token_file=security.token_file)
        sidecars = plain if render.startswith("unix:") and derender.startswith("unix:") else security
        self.pipelines = [AsyncChatPipeline(Endpoints(render, engine, derender), timeout=timeout,
                                            max_message_bytes=max_message_bytes,
                                            security=plain if engine.startswith("unix:") else security,
                                            sidecar_security=sidecars)
                          for engine in engines]
        self.in_flight = [0] * len(engines)
        self._turn = itertools.count()

    async def close(self) -> None:
        for pipeline in self.pipelines:
            await pipeline.close()

    def pick(self) -> int:
        """The engine with the fewest requests in flight; among equals, the next in turn."""
        low = min(self.in_flight)
        candidates = [i for i, count in enumerate(self.in_flight) if count == low]
        return candidates[next(self._turn) % len(candidates)]

    @asynccontextmanager
    async def pipeline(self) -> AsyncIterator[AsyncChatPipeline]:
        index = self.pick()
        self.in_flight[index] += 1
        try:
            yield self.pipelines[index]
        finally:
            self.in_flight[index] -= 1

    async def health(self) -> dict[str, str]:
        """Each service's health: render, derender and every engine (by address when several)."""
        states: dict[str, str] = {}
        for i, pipeline in enumerate(self.pipelines):
            found = await pipeline.check_health()
            if i == 0:
                states["render"], states["derender"] = found["render"], found["derender"]
            states["engine" if len(self.pipelines) == 1 else f"engine {self.addresses[i]}"] = found["engine"]
        return states
