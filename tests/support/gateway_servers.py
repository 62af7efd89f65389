"""A gateway started in-process for tests that run servers on a private loop (conftest's AioServer),
and render and derender of one model to put gateways over engines with (`Front`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tito.v1 import chat_pb2, render_pb2, render_pb2_grpc

TIMEOUT = 60


class StoppableGateway:
    """A started gateway as AioServer stops servers (`stop(grace)`)."""

    def __init__(self, running):
        self.running, self.address = running, running.address

    async def stop(self, grace: float) -> None:
        await self.running.stop()


@dataclass
class Front:
    """render and derender of one model, for gateways over engines of that model."""

    render: Any
    derender: Any
    start: Any  # module_aio_server

    def gateway(self, engine_address: str, **config) -> str:
        """A started gateway's /v1 URL."""
        from tito_gateway.config import GatewayConfig
        from tito_gateway.server import create_server as create_gateway

        async def gateway():
            return StoppableGateway(await create_gateway(GatewayConfig(
                address="127.0.0.1:0", render_address=self.render.address, engine_address=engine_address,
                derender_address=self.derender.address, served_model_name="tiny", **config)))

        return f"http://{self.start(gateway).address}/v1"

    def prompt(self, content: str) -> list[int]:
        """The token ids render gives a one-message chat."""
        with self.render.channel() as channel:
            rendered = render_pb2_grpc.RenderServiceStub(channel).RenderChat(render_pb2.RenderChatRequest(
                messages=[chat_pb2.ChatMessage(role="user", content=content)]), timeout=TIMEOUT)
        return list(rendered.generate_request.token_ids)
