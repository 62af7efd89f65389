"""A gateway started in-process for tests that run servers on a private loop (conftest's AioServer)."""

from __future__ import annotations


class StoppableGateway:
    """A started gateway as AioServer stops servers (`stop(grace)`)."""

    def __init__(self, running):
        self.running, self.address = running, running.address

    async def stop(self, grace: float) -> None:
        await self.running.stop()
