"""A derender stream's state as a sealed blob the caller carries: stateless derender per call
(vLLM's streamed derender shape) without vLLM's replay of the whole output on every chunk.

vLLM's `stream_state` holds every output token so far and rebuilds its parser by replaying them
on each chunk: O(n) bytes and work per chunk, O(n^2) per stream. Here the state is the stream
itself (detokenizer window, held-back stop-string and marker text, parser states, counts): its
size depends on what is still held back (a few tokens, at most one unfinished tool call), not on
the output's length, and each chunk costs its own tokens plus a fixed (de)serialization.

Format: `version (1 byte) | HMAC-SHA256 tag (32 bytes) | zlib(pickle)`. The state is pickled
because the parsers' states are objects (bound-method state machines, lexers); the tokenizer is
left out (a persistent reference to the service's own). Unpickling forged bytes can run code, so
a blob is opened only after its tag checks out (constant-time compare) against the key this
service holds (`--stream-state-key`, shared by replicas; a random key per process by default),
and the unpickler then only resolves classes from tito's own modules (defence in depth). Both
sizes are capped: a sealed blob over MAX_STATE_BYTES is refused before any work, and
decompression stops at MAX_PICKLE_BYTES (no zip bombs). A state a newer or older derender wrote
(another version byte) is refused too: the caller restarts the derender from the first chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import secrets
import zlib

from tito.errors import InvalidArgument, ResourceExhausted
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer

VERSION = b"\x01"
TAG_BYTES = 32
#: Largest sealed state accepted or produced: a few held-back tokens and one tool call's
#: arguments fit many times over; an output's length does not change it.
MAX_STATE_BYTES = 64 * 1024
#: Largest pickle a sealed state may expand to.
MAX_PICKLE_BYTES = 1024 * 1024
FIELD = "context.resume_state"
_TOKENIZER = "tokenizer"
#: Module prefixes whose classes a state may hold (besides builtins' containers).
_ALLOWED_MODULES = ("tito_derender.", "tito.")
_ALLOWED_BUILTINS = frozenset(("getattr", "frozenset", "set", "slice"))


def new_key() -> bytes:
    return secrets.token_bytes(32)


class _Pickler(pickle.Pickler):
    def __init__(self, out, tokenizer: TextTokenizer) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self._tokenizer = tokenizer

    def persistent_id(self, obj):
        return _TOKENIZER if obj is self._tokenizer else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tokenizer: TextTokenizer) -> None:
        super().__init__(io.BytesIO(data))
        self._tokenizer = tokenizer

    def persistent_load(self, pid):
        if pid != _TOKENIZER:
            raise pickle.UnpicklingError("unknown persistent reference")
        return self._tokenizer

    def find_class(self, module: str, name: str):
        if module.startswith(_ALLOWED_MODULES) or (module == "builtins" and name in _ALLOWED_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a derender state")


class StateSealer:
    """Seals and opens derender stream states with one key."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or new_key()

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, VERSION + payload, hashlib.sha256).digest()

    def seal(self, stream: DerenderStream, tokenizer: TextTokenizer) -> bytes:
        out = io.BytesIO()
        _Pickler(out, tokenizer).dump(stream)
        payload = zlib.compress(out.getvalue(), 1)
        blob = VERSION + self._tag(payload) + payload
        if len(blob) > MAX_STATE_BYTES:
            raise ResourceExhausted(
                f"the derender state grew to {len(blob)} bytes, more than the {MAX_STATE_BYTES} a resumable "
                f"stream may carry (a tool call too long to hold back): derender this output whole",
                reason="STREAM_STATE_TOO_LARGE", field=FIELD)
        return blob

    def open(self, blob: bytes, tokenizer: TextTokenizer) -> DerenderStream:
        """The stream `blob` holds; InvalidArgument naming the field if it is not one this key sealed."""
        if len(blob) > MAX_STATE_BYTES:
            raise InvalidArgument(f"the stream state is {len(blob)} bytes, more than the {MAX_STATE_BYTES} "
                                  f"derender ever returns", reason="STREAM_STATE_TOO_LARGE", field=FIELD)
        if len(blob) <= 1 + TAG_BYTES or blob[:1] != VERSION:
            raise InvalidArgument("the stream state is not one derender returned (or another version wrote it): "
                                  "send back the state of the previous call unchanged",
                                  reason="STREAM_STATE_INVALID", field=FIELD)
        tag, payload = blob[1:1 + TAG_BYTES], blob[1 + TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(payload)):
            raise InvalidArgument("the stream state's integrity tag does not match: it was changed, or another "
                                  "derender key sealed it", reason="STREAM_STATE_INVALID", field=FIELD)
        try:
            inflater = zlib.decompressobj()
            data = inflater.decompress(payload, MAX_PICKLE_BYTES)
            if inflater.unconsumed_tail:
                raise ValueError("state expands past its limit")
            stream = _Unpickler(data, tokenizer).load()
        except Exception as exc:  # noqa: BLE001 - sealed by this key, yet unreadable (another build)
            raise InvalidArgument(f"the stream state cannot be read ({type(exc).__name__}): restart the derender "
                                  f"from the first chunk", reason="STREAM_STATE_INVALID", field=FIELD) from exc
        if not isinstance(stream, DerenderStream):
            raise InvalidArgument("the stream state holds no derender stream", reason="STREAM_STATE_INVALID",
                                  field=FIELD)
        return stream
