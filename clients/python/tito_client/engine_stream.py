"""An engine Generate stream behind an `EngineRouter`, moved to another engine when its engine
goes away (migration.py says what moves and how), and each choice of an n > 1 request continued
on its own after such a move. It stands where the gRPC call stood: iterate
it for GenerateResponses, `cancel()` it to abort. One class per gRPC flavour (threads, asyncio);
both keep the router's in-flight count per engine and its view of engines (an engine that fails
is left out of later picks at once).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from tito.v1 import engine_pb2
from tito_client.migration import RequestProgress, engine_gone
from tito_client.routing import EngineRouter, NoEngineAvailable

#: Opens a Generate call on the engine at an address: (address, request) -> the call.
OpenCall = Callable[[str, engine_pb2.GenerateRequest], object]

_NextCall = tuple[str | None, engine_pb2.GenerateRequest | None, list[engine_pb2.GenerateResponse]]


class _Migrations:
    """What both flavours share: the request's progress and the decision to move it."""

    def __init__(self, router: EngineRouter, request: engine_pb2.GenerateRequest, first_address: str):
        self.router = router
        self.progress = RequestProgress(request)
        self.address = first_address  # the engine serving the request now
        self.cancelled = False
        router.reserve(first_address)

    def after_call(self, error: grpc.RpcError | None) -> _NextCall:
        """Once a call ended (`error`: how it failed; None: it ended normally): where and what to
        send next (None when the request is complete, or a normal end left nothing to continue),
        and the messages to give the caller first. Raises `error` when it must reach the caller."""
        progress = self.progress
        if progress.complete or (error is None and not progress.served_finished()):
            return None, None, []
        if error is not None:
            if self.cancelled or not engine_gone(error) or progress.migrations >= self.router.migration_limit:
                raise error
            progress.migrated()
        request, closing = progress.next_call()
        if request is None:
            return None, None, closing
        try:
            address = self.router.pick(request, avoid=self.address if error is not None else None).address
        except NoEngineAvailable:
            if error is not None:
                raise error from None
            raise
        self.router.reserve(address)
        self.address = address
        return address, request, closing


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
        while request is not None:
            state.router.adapter_ready(address, request.lora_name)  # the router may be loading it there
            with self._lock:
                if state.cancelled:
                    return
                call = self._call = self._open(address, request)
            error = None
            try:
                with state.router.track(address):
                    for response in call:
                        yield state.progress.record(response)
            except grpc.RpcError as failed:
                error = failed
            address, request, closing = state.after_call(error)
            yield from closing


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
        """The id the engine serving the request now knows it by (a continuation's id differs)."""
        return self._request_id

    def cancel(self) -> None:
        self._state.cancelled = True
        if self._call is not None:
            self._call.cancel()

    def cancelled(self) -> bool:
        return self._state.cancelled

    async def __aiter__(self) -> AsyncIterator[engine_pb2.GenerateResponse]:
        state, request, address = self._state, self._state.progress.request, self._state.address
        while request is not None and not state.cancelled:
            await state.router.adapter_ready_async(address, request.lora_name)  # the router may be loading it
            if state.cancelled:
                return
            call = self._call = self._open(address, request)
            error = None
            try:
                with state.router.track(address):
                    async for response in call:
                        yield state.progress.record(response)
            except grpc.RpcError as failed:
                error = failed
            address, request, closing = state.after_call(error)
            for response in closing:
                yield response
            if request is not None:
                self._request_id = request.request_id
