"""Kimi-K2 tool calls: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>` ID
`<|tool_call_argument_begin|>` {...} `<|tool_call_end|>`, then `<|tool_calls_section_end|>`.

The ID is `functions.NAME:N` (N counts the calls of the conversation); the function name is
what lies between "functions." and the last ":". An ID that is only the counter (`0`) names no
function: the call is to the one tool the request accepts; when it accepts several, to the one
tool its arguments fit (`fitting_tools`), read whole before anything is sent, and no call (its
markup is content) when none or several fit. The ID is the call's id (the chat template
renders it back into the conversation, and a tool result answers it). The markers are special
tokens: render keeps special tokens in the text for this parser (skip_special_tokens defaults to
false), else they never reach it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tito_derender.parsers.tools.json_scan import JsonLexer
from tito_derender.parsers.tools.markup import WAIT, MarkupToolParser, ObjectArguments

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:]+?)(?::\d+)?")
#: An id that is only the call counter (`0`): Kimi-K2 sometimes drops the `functions.NAME:` part.
_BARE_COUNTER = re.compile(r"\d+")


def function_name(call_id: str) -> str | None:
    match = _CALL_ID.fullmatch(call_id)
    return match.group("name") if match else None


def fitting_tools(arguments: Any, candidates: Iterable[str], schemas: Mapping[str, Any]) -> list[str]:
    """The tools among `candidates` whose parameters schema fits `arguments` (a JSON object):
    every argument is one of its declared properties and every property it requires is given."""
    if not isinstance(arguments, dict):
        return []
    fits = []
    for name in candidates:
        schema = schemas.get(name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        required = schema.get("required") if isinstance(schema, dict) else None
        declared = set(properties) if isinstance(properties, dict) else set()
        needed = {key for key in required if isinstance(key, str)} if isinstance(required, list) else set()
        if set(arguments) <= declared and needed <= set(arguments):
            fits.append(name)
    return fits


class KimiK2ToolParser(MarkupToolParser):
    #: A call opened inside the reasoning may end it (see ToolParser.call_markers).
    call_markers = (SECTION_BEGIN, SECTION_END)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._call_id = ""
        self._name = ""
        self._candidates: list[str] = []  # the tools a bare counter id may mean
        self._lexer: JsonLexer | None = None  # reads the arguments of such a call
        self._object_at = 0  # where its arguments begin in `_raw`

    def _content_state(self, text: str) -> str | None:
        return self._open(text, SECTION_BEGIN, self._section)

    def _section(self, text: str) -> str | None:
        return self._between_calls(text, CALL_BEGIN, self._call_header, SECTION_END)

    def _broken(self, text: str) -> str:
        """This call is none: its markup is content and the section goes on."""
        return self._break_call(text, CALL_END, self._section)

    def _call_header(self, text: str) -> str | None:
        split = self._header(text, ARGUMENT_BEGIN)
        if not split:
            return WAIT if split is None else self._broken(text)
        before, _, after = split
        self._call_id = before.strip()
        self._name, self._candidates = "", []
        if _BARE_COUNTER.fullmatch(self._call_id):
            self._candidates = [name for name in sorted(self.tool_names) if self.accept_name(name)]
            if not self._candidates:
                return self._reject(text, CALL_END, self._section)
            if len(self._candidates) == 1:
                self._name = self._candidates[0]
        else:
            self._name = function_name(self._call_id) or ""
            if not self._name:
                return self._broken(text)
            if not self.accept_name(self._name):
                return self._reject(text, CALL_END, self._section)
        self._state = self._arguments_start
        return self._consume(text, len(text) - len(after))

    def _arguments_start(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        if stripped[0] != "{":
            return self._broken(text)
        text = self._consume(text, len(text) - len(stripped))
        if self._name:
            self._call, self._state = ObjectArguments(self, self._name, self._call_id), self._object
        else:  # a bare counter id, several tools: which one is meant shows in the arguments
            self._lexer, self._object_at = JsonLexer(object_only=True), len(self._raw)
            self._state = self._unnamed_object
        return text

    def _object(self, text: str) -> str | None:
        return self._feed_object(text, self._call_end, self._broken)

    def _unnamed_object(self, text: str) -> str | None:
        """The arguments of a call whose id is only a counter while the request accepts several
        tools: read whole, nothing sent, then the call is to the one tool they fit; when none or
        several fit, which function is meant cannot be known: the call's markup is content."""
        consumed = self._lexer.feed(text)
        rest = self._consume(text, consumed)
        if self._lexer.error:
            return self._broken(rest)
        if not self._lexer.done:
            return rest
        arguments = self._raw[self._object_at:]
        fits = fitting_tools(json.loads(arguments), self._candidates, self.tools)
        if len(fits) != 1:
            return self._reject(rest, CALL_END, self._section)
        self._raw = self._raw[:self._object_at]
        self._name, self._call = fits[0], ObjectArguments(self, fits[0], self._call_id)
        self._call.feed(arguments)
        self._done()
        self._state = self._call_end
        return rest

    def _call_end(self, text: str) -> str | None:
        return self._expect(text, {CALL_END: self._section})


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = KimiK2ToolParser
