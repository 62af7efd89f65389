"""The gateway's entry point (`server.serve`): once the listener is up it freezes the start-up heap
out of the garbage collector's walks, then serves until SIGTERM and stops."""

from __future__ import annotations

import asyncio
import os
import signal

from tito_gateway import server


def test_serve_freezes_the_heap_once_after_start_up_then_stops_on_sigterm(monkeypatch):
    events: list[str] = []

    class Running:  # what serve needs of a RunningGateway
        def __init__(self) -> None:
            self.task = asyncio.get_running_loop().create_future()  # the HTTP server, serving until stopped

        async def stop(self) -> None:
            events.append("stopped")
            self.task.cancel()

    async def create_server(config, phases=None):
        events.append("listening")
        return Running()

    monkeypatch.setattr(server, "create_server", create_server)
    monkeypatch.setattr(server, "freeze_startup_heap", lambda: events.append("frozen") or 0)

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(server.serve(config=None), timeout=10)

    asyncio.run(main())
    assert events == ["listening", "frozen", "stopped"]
