"""The DerenderService servicer (grpc.aio): proto in, domain call, proto out. Nothing else."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tito.errors import InvalidArgument, LoadingGate, TitoError, Unavailable
from tito.grpc_errors import internal_status, status_for
from tito.logs import bind_request_id
from tito.v1 import derender_pb2, derender_pb2_grpc
from tito_derender.batch import StreamSet
from tito_derender.convert import (
    chat_chunk_to_proto, choice_to_proto, chunk_to_proto, context_from_proto, output_from_proto, text_options,
    usage_to_proto)
from tito_derender.detokenizer import detokenize
from tito_derender.full import derender_full
from tito_derender.observe import DerenderMetrics
from tito_derender.resume import StateSealer
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

_ENDED = derender_pb2.DerenderBatchEnded()


class DerenderServicer(derender_pb2_grpc.DerenderServiceServicer):
    def __init__(self, tokenizer: TextTokenizer | None = None, metrics: DerenderMetrics | None = None,
                 sealer: StateSealer | None = None) -> None:
        self._tokenizer: LoadingGate[TextTokenizer] = LoadingGate("derender", tokenizer)
        #: Seals the states of streams that return theirs (DerenderContext.return_state).
        self.sealer = sealer or StateSealer()
        #: Derender streams currently holding state (for operators and tests: drops release it).
        self.live_streams = 0
        self.metrics = metrics  # set by the server when it serves /metrics
        #: Shutdown has begun: DerenderBatch calls take no new streams and end once theirs have.
        self.draining = False
        self._idle_batch_calls: set[asyncio.Event] = set()  # set to wake an idle call as draining begins

    def set_tokenizer(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer.open(tokenizer)

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer.get()

    async def Derender(self, request_iterator: AsyncIterator[derender_pb2.DerenderRequest],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[derender_pb2.DerenderResponse]:
        stream: DerenderStream | None = None
        return_state = False
        chunks = 0
        self.live_streams += 1
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if stream is None:
                    if kind != "context":
                        raise InvalidArgument(
                            "the first message of a Derender stream must be a DerenderContext (the `context` "
                            "field of render's response), then the engine's GenerateResponses",
                            reason="CONTEXT_REQUIRED", field="context")
                    return_state = request.context.return_state
                    if request.context.resume_state:
                        stream = self.sealer.open(request.context.resume_state, self.tokenizer)
                        bind_request_id(stream.context.request_id)
                        continue
                    domain_context = context_from_proto(request.context)
                    bind_request_id(domain_context.request_id)
                    stream = DerenderStream(self.tokenizer, domain_context)
                    log.debug("derender stream started (n=%d)", stream.n)
                    continue
                if kind != "generate_response":
                    raise InvalidArgument(
                        "only the first message of a Derender stream may be a context; later messages must "
                        "be GenerateResponses" if kind == "context" else
                        "a Derender message must set `generate_response` after the context",
                        reason="UNEXPECTED_CONTEXT" if kind == "context" else "EMPTY_MESSAGE",
                        field="context" if kind == "context" else "generate_response")
                for chunk in stream.feed(output_from_proto(request.generate_response)):
                    chunks += 1
                    yield chunk_to_proto(chunk)
            if stream is not None and return_state:
                yield derender_pb2.DerenderResponse(stream_state=self.sealer.seal(stream, self.tokenizer))
            elif stream is not None and not stream.finished:
                log.info("client closed the derender stream with choices %s unfinished", stream.unfinished_choices)
        finally:
            # Runs on normal end, on error and on cancellation (client dropped the call): the
            # stream's state goes with this frame.
            self.live_streams -= 1
            if self.metrics is not None:
                self.metrics.stream_ended(stream, chunks)

    async def DerenderBatch(self, request_iterator: AsyncIterator[derender_pb2.DerenderBatchRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[derender_pb2.DerenderBatchResponse]:
        streams = StreamSet(lambda: self.tokenizer, self._batch_stream_ended)
        requests = aiter(request_iterator)
        try:
            while True:
                # With streams open the next message is on its way; an idle call also wakes when
                # shutdown begins, so that it does not hold the grace period.
                request = await anext(requests, None) if len(streams) else await self._next_unless_draining(requests)
                if request is None:
                    return
                results = []
                for entry in request.entries:
                    self._apply_entry(streams, entry, results)
                if results:
                    yield derender_pb2.DerenderBatchResponse(results=results)
                if self.draining and not len(streams):
                    return
        finally:  # normal end, error or cancellation: the call's streams go with it
            streams.end_all()

    def drain(self) -> None:
        """Shutdown has begun: batch calls refuse new streams, and each ends once its open streams
        have (an idle one at once), instead of holding the grace period."""
        self.draining = True
        for wake in self._idle_batch_calls:
            wake.set()

    async def _next_unless_draining(self, requests):
        """The call's next message, or None once it has ended or shutdown has begun."""
        if self.draining:
            return None
        wake = asyncio.Event()
        self._idle_batch_calls.add(wake)
        reading, woken = asyncio.ensure_future(anext(requests, None)), asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait((reading, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._idle_batch_calls.discard(wake)
            woken.cancel()
        if reading.done():
            return reading.result()
        reading.cancel()
        return None

    def _apply_entry(self, streams: StreamSet, entry: derender_pb2.DerenderBatchEntry, results: list) -> None:
        """One entry of a DerenderBatch call; its chunks, or the error that ended its stream, go
        to `results`. A stream's error ends that stream only."""
        stream_id, kind = entry.stream_id, entry.WhichOneof("kind")
        try:
            if kind == "generate_response":
                chunks, ended = streams.feed(stream_id, output_from_proto(entry.generate_response,
                                                                          field="entries.generate_response"))
                for chunk in chunks:
                    results.append(derender_pb2.DerenderBatchResult(stream_id=stream_id,
                                                                    chunk=chat_chunk_to_proto(chunk)))
                if ended:
                    results.append(derender_pb2.DerenderBatchResult(stream_id=stream_id, ended=_ENDED))
            elif kind == "context":
                try:
                    if self.draining:
                        raise Unavailable("derender is shutting down: send the request to another derender",
                                          reason="SHUTTING_DOWN")
                    streams.open(stream_id, context_from_proto(entry.context))
                except BaseException:
                    streams.refused(stream_id)
                    raise
                self.live_streams += 1
            elif kind == "close":
                if streams.end(stream_id):
                    results.append(derender_pb2.DerenderBatchResult(stream_id=stream_id, ended=_ENDED))
            else:
                raise InvalidArgument("a DerenderBatch entry must set `context`, `generate_response` or `close`",
                                      reason="EMPTY_MESSAGE", field="entries")
        except TitoError as exc:
            log.info("derender batch stream %d rejected: %s %s: %s", stream_id, exc.code_name, exc.reason,
                     exc.message)
            streams.end(stream_id)
            results.append(derender_pb2.DerenderBatchResult(stream_id=stream_id, error=status_for(exc)))
        except Exception:  # noqa: BLE001 - a bug ends this stream, not the others of the call
            log.exception("derender batch stream %d failed with an unexpected error", stream_id)
            streams.end(stream_id)
            results.append(derender_pb2.DerenderBatchResult(stream_id=stream_id, error=internal_status()))

    def _batch_stream_ended(self, stream: DerenderStream | None, chunks: int) -> None:
        if stream is not None:
            self.live_streams -= 1
        if self.metrics is not None:
            self.metrics.stream_ended(stream, chunks)

    async def DerenderFull(self, request: derender_pb2.DerenderFullRequest,
                           context: grpc.aio.ServicerContext) -> derender_pb2.DerenderFullResponse:
        domain_context = context_from_proto(request.context)
        bind_request_id(domain_context.request_id)
        outputs = [output_from_proto(response, field=f"responses[{i}]")
                   for i, response in enumerate(request.responses)]
        tokenizer = self.tokenizer
        choices, usage = await _off_loop_if_large(
            sum(len(o.token_ids) for o in outputs), derender_full, tokenizer, domain_context, outputs,
            self.metrics.choices_done if self.metrics is not None else None)
        return derender_pb2.DerenderFullResponse(choices=[choice_to_proto(c) for c in choices],
                                                 usage=usage_to_proto(usage))

    async def Detokenize(self, request: derender_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> derender_pb2.DetokenizeResponse:
        vocab = self.tokenizer.vocab_size
        for position, token_id in enumerate(request.token_ids):
            if token_id >= vocab:
                raise InvalidArgument(f"token id {token_id} is outside the vocabulary [0, {vocab})",
                                      reason="TOKEN_ID_OUT_OF_RANGE", field=f"token_ids[{position}]")
        text = await _off_loop_if_large(len(request.token_ids), detokenize, self.tokenizer,
                                        list(request.token_ids), text_options(request))
        return derender_pb2.DetokenizeResponse(text=text)


#: Token counts above which whole-output work runs on a thread, so one big unary call does not
#: stall every stream sharing the event loop.
_OFF_LOOP_TOKENS = 4096


async def _off_loop_if_large(token_count: int, function, *args):
    if token_count > _OFF_LOOP_TOKENS:
        return await asyncio.to_thread(function, *args)
    return function(*args)
