"""Mistral tool calls, in both forms Mistral tokenizers have used:

- v11 and later (Mistral Small 3.1+, Ministral, Devstral, Magistral): each call is
  `[TOOL_CALLS]name{"arg": ...}`, the arguments a JSON object right after the function name
  (v13 tokenizers put an `[ARGS]` token between them). Several calls repeat the marker:
  `[TOOL_CALLS]a{...}[TOOL_CALLS]b{...}`.
- before v11 (Mistral 7B v0.3, Mixtral, Nemo): `[TOOL_CALLS]` followed by a JSON array of
  {"name", "arguments"} objects (a single bare object is accepted too).

Text before the marker is content, as is text after a call. `[TOOL_CALLS]` is a special token
in Mistral tokenizers: it reaches derender's text only with skip_special_tokens false, which is
why tito.parsers declares this format `needs_special_tokens` and render turns skip_special_tokens
off by default for requests it parses.

In the v11 form the name is known before the arguments, so a call is sent (name delta) once its
arguments object opens, and the arguments stream as the lexer validates them; a call that breaks
after that has its arguments closed (as for the other JSON parsers), one that breaks before is
content.
"""

from __future__ import annotations

import re

from tito_derender.parsers.markers import partial_marker_length
from tito_derender.parsers.tools.base import DONE, FAILED, Event, JsonCall, ToolParser
from tito_derender.parsers.tools.json_scan import JsonLexer

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"

_CONTENT, _OPEN, _ELEMENT, _CALL, _SEPARATOR, _NAME, _AFTER_NAME, _ARGUMENTS = range(8)
_NAME_START = re.compile(r"[A-Za-z_]")
_NAME_RUN = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _CONTENT
        self._held = ""
        self._raw_prefix = ""  # the markup read since the marker, for content if it is no call
        self._in_array = False
        self._call: JsonCall | None = None
        self._name = ""
        self._arguments_lexer: JsonLexer | None = None
        self._arguments_text = ""  # the v11 call's arguments while not streaming
        self._index: int | None = None  # the v11 call's index once its name is out

    def feed(self, text: str) -> list[Event]:
        text = self._held + text
        self._held = ""
        while text:
            if self._mode == _CONTENT:
                rest = self._content_until(text, MARKER)
                if rest is None:
                    break
                self._mode, self._raw_prefix = _OPEN, MARKER
                text = rest
            elif self._mode in (_NAME, _AFTER_NAME, _ARGUMENTS):
                text = self._named_call(text)
            elif self._mode == _CALL:
                text = self._list_call(text)
            else:
                stripped = text.lstrip()
                self._raw_prefix += text[:len(text) - len(stripped)]
                if not stripped:
                    break
                text = self._list_markup(stripped)
        return self._take_events()

    # -- the pre-v11 form: a JSON list of call objects
    def _list_markup(self, text: str) -> str:
        """After the marker (_OPEN), between list elements (_ELEMENT) or after one (_SEPARATOR)."""
        char = text[0]
        if self._mode == _OPEN:
            if char == "[":
                self._mode, self._in_array, self._raw_prefix = _ELEMENT, True, self._raw_prefix + "["
                return text[1:]
            if char == "{":
                self._mode, self._in_array, self._call = _CALL, False, JsonCall(self)
            elif _NAME_START.match(char):
                self._mode, self._name = _NAME, ""
            else:
                self._give_up()
        elif self._mode == _ELEMENT:
            if char == "{":
                self._mode, self._call = _CALL, JsonCall(self)
            elif char == "]" and self.calls_made:
                self._mode = _CONTENT
                return text[1:]
            else:
                self._give_up()
        else:  # _SEPARATOR
            if char in ",]":
                self._mode = _ELEMENT if char == "," else _CONTENT
                return text[1:]
            self._mode = _CONTENT  # a missing "]": the rest is content
        return text

    def _list_call(self, text: str) -> str:
        consumed = self._call.feed(text)
        if self._call.status == FAILED:
            self._fail_call()
        elif self._call.status == DONE:
            self._raw_prefix = ""
            self._mode = _SEPARATOR if self._in_array else _CONTENT
        return text[consumed:]

    # -- the v11+ form: name, optional [ARGS], arguments object
    def _named_call(self, text: str) -> str:
        if self._mode == _NAME:
            match = _NAME_RUN.match(text)
            if match:
                self._name += match.group()
                self._raw_prefix += match.group()
                return text[match.end():]
            self._mode = _AFTER_NAME
            return text
        if self._mode == _AFTER_NAME:
            return self._before_arguments(text)
        return self._read_arguments(text)

    def _before_arguments(self, text: str) -> str:
        """Between the name and its arguments: optional whitespace and [ARGS], then "{"."""
        stripped = text.lstrip()
        self._raw_prefix += text[:len(text) - len(stripped)]
        if not stripped:
            return ""
        if stripped.startswith(ARGS_MARKER):
            self._raw_prefix += ARGS_MARKER
            return stripped[len(ARGS_MARKER):]
        if len(stripped) < len(ARGS_MARKER) and partial_marker_length(stripped, ARGS_MARKER) == len(stripped):
            self._held = stripped  # maybe the start of [ARGS]: wait for the next piece
            return ""
        if stripped[0] != "{" or not self.accept_name(self._name):
            self._give_up()
            return stripped
        self._mode, self._arguments_lexer = _ARGUMENTS, JsonLexer(object_only=True)
        if self.streaming:
            self._index = self._start_call(self._name)
        return stripped

    def _read_arguments(self, text: str) -> str:
        lexer = self._arguments_lexer
        consumed = lexer.feed(text)
        piece = text[:consumed]
        if self._index is not None:
            self._arguments(self._index, piece)
        else:
            self._raw_prefix += piece
            self._arguments_text += piece
        if lexer.error:
            self._end_named_call(failed=True)
        elif lexer.done:
            self._end_named_call(failed=False)
        return text[consumed:]

    def _end_named_call(self, *, failed: bool) -> None:
        if self._index is not None:  # streaming: the call is out
            if failed:
                self._arguments(self._index, self._arguments_lexer.completion(0))
        elif failed:
            self._content(self._raw_prefix)
        else:  # not streaming: the whole call now
            self._arguments(self._start_call(self._name), self._arguments_text)
        self._raw_prefix, self._arguments_text, self._index, self._arguments_lexer = "", "", None, None
        self._mode = _CONTENT

    # -- failures
    def _give_up(self) -> None:
        """Not a call after all: the consumed markup is content; read on as content."""
        self._content(self._raw_prefix)
        self._raw_prefix = ""
        self._mode = _CONTENT

    def _fail_call(self) -> None:
        name_sent = self._call.name_sent
        raw = self._call.fail()
        self._content(raw if name_sent else self._raw_prefix + raw)
        self._raw_prefix = ""
        self._mode = _CONTENT

    def finish(self) -> list[Event]:
        if self._mode == _CALL:
            self._fail_call()
        elif self._mode == _ARGUMENTS:
            self._end_named_call(failed=True)
        elif self._mode in (_OPEN, _ELEMENT, _NAME, _AFTER_NAME):
            self._raw_prefix += self._held
            self._give_up()
        elif self._mode == _CONTENT:
            self._content(self._held)
        self._held = ""
        self._mode = _CONTENT
        return self._take_events()


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = MistralToolParser
