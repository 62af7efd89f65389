"""An engine Generate stream behind an `EngineRouter`, moved to another engine when its engine
goes away (migration.py says what moves and how). It stands where the gRPC call stood: iterate
it for GenerateResponses, `cancel()` it to abort. One class per gRPC flavour (threads, asyncio);
both keep the router's in-flight count per engine and its view of engines (an engine that fails
is left out of later picks at once).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from tito.v1 import engine_pb2
from tito_client.migration import ChoiceProgress, can_migrate, engine_gone
from tito_client.routing import EngineRouter, NoEngineAvailable

#: Opens a Generate call on the engine at an address: (address, request) -> the call.
OpenCall = Callable[[str, engine_pb2.GenerateRequest], object]


class _Migrations:
    """What both flavours share: the choice's progress and the decision to move it."""

    def __init__(self, router: EngineRouter, request: engine_pb2.GenerateRequest, first_address: str):
        self.router = router
        self.progress = ChoiceProgress(request)
        self.address = first_address  # the engine serving the choice now
        self.cancelled = False
        self._movable = can_migrate(request)

    def next_engine(self, error: grpc.RpcError) -> tuple[str, engine_pb2.GenerateRequest] | None:
        """Where and what to send after `error`, or None when the choice is complete (the engine
        died after its last token, or even after saying so). Raises `error` when it must reach the
        caller."""
        if self.progress.finished:
            return None
        if (self.cancelled or not self._movable or not engine_gone(error)
                or self.progress.migrations >= self.router.migration_limit):
            raise error
        budget = self.progress.remaining_budget()
        if budget is not None and budget < 1:
            return None
        request = self.progress.continuation()
        try:
            address = self.router.pick(request, avoid=self.address).address
        except NoEngineAvailable:
            raise error from None
        self.progress.migrated()
        self.address = address
        return address, request


class MigratingStream:
    """A synchronous Generate stream that survives its engine (grpc's threads)."""

    def __init__(self, router: EngineRouter, open_call: OpenCall, request: engine_pb2.GenerateRequest,
                 address: str):
        self._state = _Migrations(router, request, address)
        self._open = open_call
        self._lock = threading.Lock()
        self._call = None

    @property
    def address(self) -> str:
        return self._state.address

    def cancel(self) -> None:
        with self._lock:
            self._state.cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def __iter__(self) -> Iterator[engine_pb2.GenerateResponse]:
        state, request, address = self._state, self._state.progress.request, self._state.address
        while True:
            state.router.adapter_ready(address, request.lora_name)  # the router may be loading it there
            with self._lock:
                if state.cancelled:
                    return
                call = self._call = self._open(address, request)
            try:
                with state.router.track(address):
                    for response in call:
                        yield state.progress.record(response)
                return
            except grpc.RpcError as error:
                moved = state.next_engine(error)
                if moved is None:
                    if not state.progress.finished:
                        yield state.progress.length_finish()
                    return
                address, request = moved


class AsyncMigratingStream:
    """`MigratingStream` on grpc.aio."""

    def __init__(self, router: EngineRouter, open_call: OpenCall, request: engine_pb2.GenerateRequest,
                 address: str):
        self._state = _Migrations(router, request, address)
        self._open = open_call
        self._call = None
        self._request_id = request.request_id

    @property
    def address(self) -> str:
        return self._state.address

    @property
    def request_id(self) -> str:
        """The id the engine serving the choice now knows it by (a continuation's id differs)."""
        return self._request_id

    def cancel(self) -> None:
        self._state.cancelled = True
        if self._call is not None:
            self._call.cancel()

    def cancelled(self) -> bool:
        return self._state.cancelled

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        state, request, address = self._state, self._state.progress.request, self._state.address
        while not state.cancelled:
            await state.router.adapter_ready_async(address, request.lora_name)  # the router may be loading it
            if state.cancelled:
                return
            call = self._call = self._open(address, request)
            try:
                with state.router.track(address):
                    async for response in call:
                        yield state.progress.record(response)
                return
            except grpc.RpcError as error:
                moved = state.next_engine(error)
                if moved is None:
                    if not state.progress.finished:
                        yield state.progress.length_finish()
                    return
                address, request = moved
                self._request_id = request.request_id
