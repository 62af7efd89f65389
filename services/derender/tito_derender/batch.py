"""Many Derender streams of one DerenderBatch call, by the caller's stream ids.

A router serving many chats at once would otherwise hold one Derender call per chat and send a
message per chat and token; with a batch call it sends one message per engine step, holding every
chat's entries. Each stream here behaves exactly as its own Derender call (the same DerenderStream:
context first, then the engine's outputs), and ends when its last choice finishes, when it fails
(only it: the caller gets its error, the other streams go on) or when the caller closes it.

Entries for a stream that has ended are ignored rather than refused: a caller sends a step's
outputs before it can have read the error or the last chunk that ended the stream. An id that was
never opened is refused (the caller has a bug).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tito.errors import InvalidArgument, ResourceExhausted
from tito_derender.domain import Chunk, EngineOutput, RequestContext
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer

#: Open streams one call may hold: far above any engine's running requests (a few hundred), low
#: enough that a caller that never closes its streams runs out here rather than out of memory.
MAX_OPEN_STREAMS = 4096
#: Ended ids remembered (to ignore their late entries); older ones are forgotten first.
ENDED_IDS_KEPT = 65536


@dataclass
class OpenStream:
    """One stream of the call: its derender state and the chunks it has produced."""

    stream: DerenderStream
    chunks: int = 0


class StreamSet:
    """The open streams of one DerenderBatch call. `on_end(stream, chunks)` is told of every
    stream that ends (any way; `stream` is None when a context was refused)."""

    def __init__(self, tokenizer: Callable[[], TextTokenizer], on_end: Callable[[DerenderStream | None, int], None],
                 max_open: int = MAX_OPEN_STREAMS) -> None:
        self._tokenizer = tokenizer
        self._on_end = on_end
        self._max_open = max_open
        self._open: dict[int, OpenStream] = {}
        self._ended: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, stream_id: int, context: RequestContext) -> None:
        """Start stream `stream_id` with its request's context."""
        if stream_id in self._open:
            raise InvalidArgument(f"stream {stream_id} is already open on this call: a context opens a stream "
                                  f"once; pick a new id, or reuse this one after the stream has ended",
                                  reason="STREAM_ALREADY_OPEN", field="entries.context")
        if len(self._open) >= self._max_open:
            raise ResourceExhausted(f"this call already holds {self._max_open} open streams: close the streams "
                                    f"you are done with (a `close` entry) or open another call",
                                    reason="TOO_MANY_STREAMS")
        self._ended.pop(stream_id, None)
        self._open[stream_id] = OpenStream(DerenderStream(self._tokenizer(), context))

    def feed(self, stream_id: int, output: EngineOutput) -> tuple[list[Chunk], bool]:
        """The chunks one engine output of stream `stream_id` makes final ([] for a stream that has
        ended), and whether the stream ended with them (after the chunk that finished its last choice)."""
        entry = self._open.get(stream_id)
        if entry is None:
            if stream_id in self._ended:
                return [], False
            raise InvalidArgument(f"stream {stream_id} was never opened on this call: its first entry must be "
                                  f"a DerenderContext", reason="CONTEXT_REQUIRED", field="entries.context")
        chunks = entry.stream.feed(output)
        entry.chunks += len(chunks)
        if entry.stream.finished:
            self._end(stream_id)
            return chunks, True
        return chunks, False

    def end(self, stream_id: int) -> bool:
        """End stream `stream_id` (the caller closed it, or it failed); whether it was still open."""
        if stream_id in self._open:
            self._end(stream_id)
            return True
        self._remember(stream_id)
        return False

    def end_all(self) -> None:
        """The call is over: every stream still open ends."""
        for stream_id in list(self._open):
            self._end(stream_id)

    def refused(self, stream_id: int) -> None:
        """A context that could not open a stream (a stream already open under the id is left to
        `end`): later entries for the id are ignored."""
        if stream_id not in self._open:
            self._remember(stream_id)
            self._on_end(None, 0)

    def _end(self, stream_id: int) -> None:
        entry = self._open.pop(stream_id)
        self._remember(stream_id)
        self._on_end(entry.stream, entry.chunks)

    def _remember(self, stream_id: int) -> None:
        self._ended[stream_id] = None
        self._ended.move_to_end(stream_id)
        if len(self._ended) > ENDED_IDS_KEPT:
            self._ended.popitem(last=False)
