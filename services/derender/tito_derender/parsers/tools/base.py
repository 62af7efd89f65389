"""What every tool-call parser shares: call ids and indices, the OpenAI delta shape, and the
tracking of one JSON call object ({"name": ..., "arguments": {...}}).

A parser is fed the choice's content text piece by piece and returns events in text order: plain
content strings and ToolCallDelta objects. For each call, the first delta carries index, id,
type and name; later deltas carry argument fragments whose concatenation is the arguments JSON
object exactly as the model wrote it (validated as it streams).

Malformed markup from the model is never an error: a call that breaks before its name was sent
goes back to content as the raw text it was; one that breaks after (the name is already out)
has its arguments closed into valid JSON (see JsonLexer.completion) and the rest is content.

`streaming=False` (DerenderFull) sends each call only once it is complete, so a non-streaming
caller never sees a repaired call: anything malformed is content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from typing import ClassVar

from tito_derender.domain import ToolCallDelta
from tito_derender.parsers.markers import partial_marker_length
from tito_derender.parsers.tools.json_scan import JsonLexer, is_json_object

Event = str | ToolCallDelta
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


#: Longest function name a call may carry.
MAX_FUNCTION_NAME_CHARS = 256
# Characters no function name holds: whitespace, controls, quotes and the brackets of markup and
# templates (`{{ tc.name }}`, `get_weather\n<parameter=city`, `f(x)`).
_NOT_IN_NAMES = re.compile(r"[\s\x00-\x1f\x7f<>{}\[\]()\"'`,;=\\]")


def valid_function_name(name: str) -> bool:
    """A name a function can have: 1 to MAX_FUNCTION_NAME_CHARS characters, none of them
    whitespace, a control character, a quote or markup / template punctuation, and not starting
    with a digit. Letters of any script, digits, `_`, `-`, `.`, `:` and `/` are fine (OpenAI's
    names, namespaced MCP tools)."""
    return (0 < len(name) <= MAX_FUNCTION_NAME_CHARS and not name[0].isdigit()
            and _NOT_IN_NAMES.search(name) is None and is_utf8(name))


def new_call_id() -> str:
    """A call id unique per call: "call_" and 24 hex digits of a random uuid."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    """Base: event output and call bookkeeping. Subclasses implement `feed` and `finish`."""

    #: (start, end) markup around each call, for parsers whose calls have both. A call found
    #: inside the reasoning may end it (reasoning.py), so a call the model opens without closing
    #: its reasoning first is still parsed.
    call_markers: ClassVar[tuple[str, str] | None] = None

    def __init__(self, *, streaming: bool = True, accept_name: Callable[[str], bool] = lambda name: True,
                 tool_names: Collection[str] = ()) -> None:
        self.streaming = streaming
        self._accept = accept_name
        self.tool_names = frozenset(tool_names)
        self.calls_made = 0
        self.malformed_calls = 0  # calls that broke (or were cut off): their text went back to content
        self._events: list[Event] = []

    def accept_name(self, name: str) -> bool:
        """Whether a call to `name` is a call: a valid function name (`valid_function_name`),
        one of the request's tools when they are given, and one the request accepts (a named
        tool_choice accepts only its function). Markup calling anything else is not a call."""
        return (valid_function_name(name) and (not self.tool_names or name in self.tool_names)
                and self._accept(name))

    # -- the parser's interface
    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    # -- helpers for subclasses
    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content_until(self, text: str, marker: str) -> str | None:
        """Emit the content before `marker` and return the text after it. When the marker has not
        appeared, emit what cannot be its start, keep the rest in `self._held` for the next feed,
        and return None."""
        position = text.find(marker)
        if position < 0:
            keep = partial_marker_length(text, marker)
            self._content(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return None
        self._content(text[:position])
        return text[position + len(marker):]

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], str):
            self._events[-1] += text
        else:
            self._events.append(text)

    def _start_call(self, name: str, call_id: str = "") -> int:
        """`call_id`: the model's own id for the call (Kimi-K2 writes one), else a new one."""
        index = self.calls_made
        self.calls_made += 1
        self._events.append(ToolCallDelta(index=index, id=call_id or new_call_id(), type="function", name=name))
        return index

    def _arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.index == index and not last.name:
            self._events[-1] = ToolCallDelta(index=index, arguments=last.arguments + fragment)
        else:
            self._events.append(ToolCallDelta(index=index, arguments=fragment))


PENDING, DONE, FAILED = "pending", "done", "failed"


class JsonCall:
    """One call written as a JSON object with a name and arguments (hermes, llama3_json,
    mistral). Emits through its parser; keeps the raw text until the name is out, so a failure
    before that can hand the text back as content."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._lexer = JsonLexer(object_only=True)
        self._raw: list[str] = []  # consumed text, kept only until the call is sent
        self.index: int | None = None  # set once the name delta is out
        self._arguments_sent = 0  # absolute offset up to which arguments were sent
        self.status = PENDING

    @property
    def name_sent(self) -> bool:
        return self.index is not None

    def raw_text(self) -> str:
        return "".join(self._raw)

    def _text(self, start: int, end: int, base: int, piece: str) -> str:
        """Consumed text [start, end): from this feed's `piece` when it lies there, else from the
        kept raw text (always complete while the name is not out or when not streaming)."""
        if start >= end:
            return ""
        if start >= base:
            return piece[start - base:end - base]
        return "".join(self._raw)[start:end]

    def _name(self) -> str | None | bool:
        """The name once complete (False when it is not a usable string)."""
        lexer = self._lexer
        for key in NAME_KEYS:
            if key in lexer.members:
                raw = lexer.strings.get(key)
                if raw is None:
                    return False
                name = json.loads(raw)  # a string the lexer validated: cannot fail
                return name if name and is_utf8(name) and self._parser.accept_name(name) else False
        return None

    def _arguments_member(self) -> tuple[str, int, int | None, str] | None:
        """(key, start, end or None while open, first character) of the arguments member."""
        lexer = self._lexer
        for key in ARGUMENT_KEYS:
            if key in lexer.members:
                start, end = lexer.members[key]
                return key, start, end, lexer.member_first[key]
        if lexer.open_key in ARGUMENT_KEYS and lexer.open_start is not None:
            return lexer.open_key, lexer.open_start, None, lexer.first_char
        return None

    def feed(self, text: str) -> int:
        """Consume call text; returns how much was consumed. Sets `status`."""
        lexer = self._lexer
        base = lexer.length
        consumed = lexer.feed(text)
        piece = text[:consumed]
        if not (self.name_sent and self._parser.streaming):
            self._raw.append(piece)
        if lexer.error:
            if self.name_sent and self._parser.streaming:
                self._send_arguments(self._arguments_member(), base, piece)  # what was valid
            self.status = FAILED
            return consumed
        name = self._name()
        if name is False:
            self.status = FAILED
            return consumed
        arguments = self._arguments_member()
        if lexer.done:
            self._complete(name, arguments, base, piece)
            return consumed
        if not self._parser.streaming or name is None or arguments is None or arguments[3] != "{":
            return consumed
        if not self.name_sent:
            self.index = self._parser._start_call(name)
            self._arguments_sent = arguments[1]
        self._send_arguments(arguments, base, piece)
        return consumed

    def _send_arguments(self, arguments, base: int, piece: str) -> None:
        """Stream the arguments text consumed since the last fragment."""
        if arguments is None:
            return
        end = arguments[2]
        upto = self._lexer.length if end is None else end
        self._parser._arguments(self.index, self._text(self._arguments_sent, upto, base, piece))
        self._arguments_sent = max(self._arguments_sent, upto)

    def _complete(self, name, arguments, base: int, piece: str) -> None:
        if name is None:
            self.status = FAILED
            return
        if arguments is None:
            text = "{}"
        else:
            _, start, end, first = arguments
            if first == "{":
                text = None  # stream the raw object (the rest of it, if some was sent)
            else:
                text = _arguments_from_other_json(self._text(start, end, base, piece))
                if text is None:
                    self.status = FAILED
                    return
        if not self.name_sent:
            self.index = self._parser._start_call(name)
            self._arguments_sent = arguments[1] if arguments else 0
        if text is not None:
            self._parser._arguments(self.index, text)
        else:
            self._parser._arguments(self.index, self._text(self._arguments_sent, arguments[2], base, piece))
        self.status = DONE
        self._raw = []

    def fail(self) -> str:
        """End a call that broke (or was cut off): close the arguments if the call is already
        out and return "", else return the raw text for content."""
        self.status = FAILED
        self._parser.malformed_calls += 1
        if not self.name_sent:
            return self.raw_text()
        arguments = self._arguments_member()
        if arguments is not None and arguments[2] is None:
            self._parser._arguments(self.index, self._lexer.completion(1))
        return ""


def is_utf8(text: str) -> bool:
    """False for text holding a lone surrogate (a JSON "\\ud800" escape decodes to one): such a
    string cannot be sent in a protobuf string field, so a call carrying it is malformed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arguments_from_other_json(raw: str) -> str | None:
    """Arguments written as a JSON string holding an object, or null: the object's JSON text.
    None (a malformed call) when the string is not one JSON object by the lexer's rules (strict,
    nested at most MAX_DEPTH deep) or decodes to a lone surrogate."""
    # `raw` is one complete value the lexer validated; only a string or null is decoded (a number
    # of thousands of digits or a nested array would be a malformed call anyway).
    if raw == "null":
        return "{}"
    if not raw.startswith('"'):
        return None
    value = json.loads(raw)  # a validated JSON string: cannot fail
    return value if is_utf8(value) and is_json_object(value) else None
