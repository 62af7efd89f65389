"""Draining: stop an engine without losing a request.

A draining engine admits nothing new (UNAVAILABLE, reason ENGINE_DRAINING: "go elsewhere"), lets
the Generate streams in flight run until the grace period ends, then aborts the rest; the servicer
ends those streams with the same UNAVAILABLE ENGINE_DRAINING instead of a normal-looking ABORT,
so a router continues each of them on another engine from the tokens it already has (request
migration, tito_client.migration). `EngineService.Drain` and SIGTERM both start it.

Runs on the server's event loop; no grpc here (the servicer turns the errors into statuses).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from tito.errors import Unavailable

from tito_engine.request import ChoiceOutput, FinishReason

ENGINE_DRAINING = "ENGINE_DRAINING"


def draining_error() -> Unavailable:
    """The status of a request refused or ended by a draining engine: continue it elsewhere."""
    return Unavailable("the engine is draining before it stops; send the request to another engine",
                       reason=ENGINE_DRAINING)


class Ticket:
    """One Generate stream in flight, under the request id the backend knows it by."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str):
        self.request_id = request_id


class Drain:
    """The engine's drain state and the streams it may have to end. `abort`: the backend's abort
    by request ids (their streams then end with ABORT)."""

    def __init__(self, abort: Callable[[list[str]], object]):
        self._abort = abort
        self._live: set[Ticket] = set()
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self.draining = False
        self.expired = False  # the grace period is over: what still runs is being ended

    def enter(self, request_id: str) -> Ticket:
        """Admit one stream (refused while draining). A request without an id gets one here, in the
        backends' own form, so the deadline can name it."""
        if self.draining:
            raise draining_error()
        ticket = Ticket(request_id or f"gen-{uuid.uuid4().hex}")
        self._live.add(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        self._live.discard(ticket)
        if self.draining and not self._live:
            self._idle.set()

    def ended_by_drain(self, output: ChoiceOutput) -> bool:
        """`output` is the ABORT the deadline caused: the stream must end as "engine gone"."""
        return self.expired and output.finish_reason is FinishReason.ABORT

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def start(self, grace_seconds: float) -> int:
        """Begin draining (or bring the deadline closer, never later); return the streams in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        self.draining = True
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)
        if not self._live:
            self._idle.set()
        return len(self._live)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is in flight (True), or `timeout` seconds (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _expire(self) -> None:
        self.expired = True
        if self._live:
            self._abort([ticket.request_id for ticket in self._live])
