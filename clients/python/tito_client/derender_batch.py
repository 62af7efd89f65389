"""Many chats' derender streams over one DerenderBatch call (asyncio).

`AsyncChatPipeline(batch_derender=True)` derenders every chat through one `DerenderBatcher`
instead of a Derender call per chat. The per-token path is then one gRPC message per engine step
for all the chats whose tokens arrived together, not one per chat and token: entries queued while
the previous message was being written go out together in the next one. Measured on 2 cores at
concurrency 32 (the gateway, 64-token chats), a message per chat and token cost derender ~120 us
of CPU per token and the gateway about as much again.

Each chat's `BatchStream` behaves as its own Derender call would: its chunks in order, then the
end, or the error that ended it (raised as a `grpc.aio.AioRpcError` carrying the same rich status,
so callers map it as they map a failed Derender call). If the batch call itself fails (derender
restarted, a network fault), every open stream gets that error and the next chat starts a new call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from tito.v1 import derender_pb2, derender_pb2_grpc

log = logging.getLogger(__name__)

_ENDED = object()  # a stream's normal end, in its queue


_CODES = {code.value[0]: code for code in grpc.StatusCode}  # google.rpc.Code numbers -> StatusCode


def _rpc_error(code: grpc.StatusCode, details: str, *trailing: tuple[str, bytes]) -> grpc.aio.AioRpcError:
    """The error a failed call raises, for a stream that fails without one."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


def status_error(status) -> grpc.aio.AioRpcError:
    """A failed RPC's error for a google.rpc.Status: its code and message, the whole status in the
    trailing metadata as gRPC sends it (grpc-status-details-bin)."""
    return _rpc_error(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message,
                      ("grpc-status-details-bin", status.SerializeToString()))


class BatchStream:
    """One chat's derender stream on a batch call: `send` the engine's responses, `close` when
    the engine stream ends (or the chat is cancelled), read `chunks()`."""

    def __init__(self, batcher: "DerenderBatcher", stream_id: int, timeout: float):
        self._batcher, self.stream_id = batcher, stream_id
        self._call = batcher._call  # its entries go to this call only (a later one never saw it)
        self._results: asyncio.Queue = asyncio.Queue()
        # The chat's deadline, as a Derender call's would be: a timer, not a wait_for per chunk.
        self._late = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"derender gave no end of the stream within {timeout:.0f}s")
        self._expiry = asyncio.get_running_loop().call_later(timeout, self._deliver, self._late)
        self._closed = self._done = False

    def send(self, response) -> None:
        if not self._closed:
            self._batcher._queue(self._call, derender_pb2.DerenderBatchEntry(stream_id=self.stream_id,
                                                                             generate_response=response))

    def close(self) -> None:
        """No more engine responses: derender ends the stream (its `ended` follows if it was open)."""
        if not self._closed:
            self._closed = True
            if not self._done:
                self._batcher._queue(self._call, derender_pb2.DerenderBatchEntry(
                    stream_id=self.stream_id, close=derender_pb2.DerenderBatchClose()))

    async def chunks(self) -> AsyncIterator[derender_pb2.ChatChunk]:
        """The stream's chunks until its end; its error, or the batch call's, is raised."""
        try:
            while True:
                item = await self._results.get()
                if item is _ENDED or isinstance(item, BaseException):
                    # Derender (or the call's failure) ended the stream: nothing to close; past its
                    # deadline it is still open there, and the close below drops it.
                    self._done = item is not self._late
                    if item is _ENDED:
                        return
                    raise item
                yield item
        finally:  # ended, failed, or the chat stopped reading (then derender is told to drop it)
            self._expiry.cancel()
            self.close()
            self._batcher._forget(self.stream_id)

    def _deliver(self, item) -> None:
        self._results.put_nowait(item)


class DerenderBatcher:
    """The DerenderBatch call that carries the streams of many chats; started at the first chat,
    restarted after it fails. Use from one event loop."""

    def __init__(self, stub: derender_pb2_grpc.DerenderServiceStub, metadata=None):
        self._stub, self._metadata = stub, metadata
        self._ids = itertools.count(1)
        self._streams: dict[int, BatchStream] = {}
        self._pending: list[derender_pb2.DerenderBatchEntry] = []
        self._wake: asyncio.Event | None = None  # the current call's writer waits on it
        self._call = None
        self._tasks: list[asyncio.Task] = []

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def open(self, context, timeout: float) -> BatchStream:
        """A new stream for a chat whose derender context is `context`; its chunks must come
        within `timeout` seconds (the chat's deadline)."""
        if self._call is None:
            self._start()
        stream = BatchStream(self, next(self._ids), timeout)
        self._streams[stream.stream_id] = stream
        self._queue(self._call, derender_pb2.DerenderBatchEntry(stream_id=stream.stream_id, context=context))
        return stream

    async def close(self) -> None:
        """End the call; chats still reading get CANCELLED."""
        call, tasks = self._call, self._tasks
        self._call, self._tasks = None, []
        self._fail_streams(_rpc_error(grpc.StatusCode.CANCELLED, "the pipeline was closed"))
        if call is not None:
            call.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self) -> None:
        # No deadline on the call: it lives as long as chats keep coming; each stream has its own.
        self._call = call = self._stub.DerenderBatch(metadata=self._metadata)
        self._wake = wake = asyncio.Event()
        self._pending.clear()
        self._tasks = [asyncio.ensure_future(self._write(call, wake)), asyncio.ensure_future(self._read(call, wake))]

    def _queue(self, call, entry) -> None:
        if call is not None and call is self._call:
            self._pending.append(entry)
            self._wake.set()

    def _forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def _write(self, call, wake: asyncio.Event) -> None:
        """Everything queued since the previous write goes out as one message."""
        try:
            while True:
                await wake.wait()
                wake.clear()
                if self._call is not call:
                    return
                entries, self._pending = self._pending, []
                if entries:
                    await call.write(derender_pb2.DerenderBatchRequest(entries=entries))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the reader sees the call's status and fails the streams
        except Exception:  # noqa: BLE001 - a write that cannot go out fails the call (the reader reports it)
            log.exception("writing to the derender batch call failed")
            call.cancel()

    async def _read(self, call, wake: asyncio.Event) -> None:
        error: BaseException = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the derender batch call failed")
        try:
            async for response in call:
                for result in response.results:
                    stream = self._streams.get(result.stream_id)
                    if stream is None:
                        continue  # a stream its chat stopped reading
                    kind = result.WhichOneof("kind")
                    if kind == "chunk":
                        stream._deliver(result.chunk)
                    elif kind == "ended":
                        stream._deliver(_ENDED)
                    elif kind == "error":
                        stream._deliver(status_error(result.error))
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "derender ended the batch call")
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the derender batch call was cancelled")
            raise
        except grpc.RpcError as exc:
            error = exc
            log.warning("the derender batch call failed (%s); open streams fail with it, the next chat starts "
                        "a new call", exc.code().name)
        except Exception:  # noqa: BLE001 - a bug here must fail the streams, not hang them
            log.exception("reading the derender batch call failed")
            call.cancel()
        finally:
            if self._call is call:
                self._call = None
                self._fail_streams(error)
            wake.set()  # the writer sees the call is gone and stops

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._deliver(error)
        self._streams.clear()
