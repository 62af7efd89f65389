"""Pythonic tool calls: the output is a Python list of calls, `[f(a=1), g(b="x", c=[1, 2])]`,
keyword arguments with Python literal values (Llama 3.2 / 4 style).

As in vLLM the list must start the output (after whitespace); otherwise the output is plain
content. Arguments stream one complete keyword argument at a time, converted to JSON
(`{"a": 1`, then `, "b": "x"`, then `}`), so each fragment costs a literal_eval of that value
only. Positional arguments, non-literal values (e.g. a nested call), values nested more than
MAX_DEPTH containers deep (as for the JSON parsers) or anything else that is not a call list make
the call malformed: content if its name was not out yet, else the arguments
are closed and the rest is content.
"""

from __future__ import annotations

import ast
import json
import re

from tito_derender.parsers.tools.base import Event, ToolParser, is_utf8
from tito_derender.parsers.tools.json_scan import MAX_DEPTH

_START, _ITEM, _NAME, _ARGS, _KEY, _EQUALS, _VALUE, _AFTER_CALL, _AFTER_ARG, _CONTENT = range(10)
_IDENTIFIER_CHAR = re.compile(r"[A-Za-z0-9_.]")
_IDENTIFIER_START = re.compile(r"[A-Za-z_]")
_VALUE_RUN = re.compile(r"""[^'"\\()\[\]{},]+""")
_OPENERS, _CLOSERS = "([{", ")]}"
# Containers a value may nest, so its arguments JSON is at most as deep as the JSON parsers allow
# (MAX_DEPTH counts their call object and arguments object too): deeper is a malformed call.
_MAX_VALUE_DEPTH = MAX_DEPTH - 2


class _Failed(Exception):
    pass


class PythonicToolParser(ToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _START
        self._raw: list[str] = []  # text since the last sent call, for content if a call fails
        self._word: list[str] = []  # identifier being read (name or key)
        self._name = ""
        self._key = ""
        self._index: int | None = None  # current call's index once its name is out (streaming)
        self._fragments: list[str] = []  # current call's argument JSON pieces
        self._value: list[str] = []
        self._depth = 0
        self._quote = ""  # inside a string literal: its quote character
        self._escape = False

    # -- argument fragments
    def _emit_fragment(self, fragment: str) -> None:
        self._fragments.append(fragment)
        if self._index is not None:
            self._arguments(self._index, fragment)

    def _open_call(self, position: int) -> None:
        name = "".join(self._word)
        if not name or name[0].isdigit() or not self.accept_name(name):
            raise _Failed(position)
        self._name, self._fragments = name, []
        if self.streaming:
            self._index = self._start_call(name)
            self._raw = []

    def _close_call(self) -> None:
        self._emit_fragment("}" if self._fragments else "{}")
        if self._index is None:  # not streaming: the whole call now
            index = self._start_call(self._name)
            self._arguments(index, "".join(self._fragments))
        self._index, self._fragments, self._raw = None, [], []

    def _finish_value(self, position: int) -> None:
        source = "".join(self._value).strip()
        try:
            value = ast.literal_eval(source)
            encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise _Failed(position) from None
        if not is_utf8(encoded):
            # A "\ud83c\udf89"-style escape: Python keeps surrogates apart, which no protobuf
            # string may carry; JSON escapes say the same thing and decode to the character.
            encoded = json.dumps(value, ensure_ascii=True, allow_nan=False)
        separator = ", " if self._fragments else "{"
        self._emit_fragment(f"{separator}{json.dumps(self._key, ensure_ascii=False)}: {encoded}")
        self._value = []

    # -- the state machine
    def feed(self, text: str) -> list[Event]:
        position = 0
        while position < len(text):
            if self._mode == _CONTENT:
                self._content(text[position:])
                break
            try:
                position = self._step(text, position)
            except _Failed as failure:
                self._fail(text[failure.args[0]:])
                break
        return self._take_events()

    def _keep(self, raw: str) -> None:
        if self._index is None:  # raw text matters only while no call is out
            self._raw.append(raw)

    def _step(self, text: str, position: int) -> int:
        """Consume some of `text` from `position`; return the new position. Raises
        _Failed(position of the first character not consumed)."""
        char = text[position]
        mode = self._mode
        if mode == _VALUE:
            return self._scan_value(text, position)
        if mode == _START and not char.isspace() and char != "[":
            self._mode = _CONTENT  # not a call list: everything is content
            self._content("".join(self._raw))
            self._raw = []
            return position
        self._read(char, mode, position)
        self._keep(char)
        return position + 1

    def _read(self, char: str, mode: int, position: int) -> None:
        if mode in (_NAME, _KEY) and _IDENTIFIER_CHAR.match(char):
            self._word.append(char)
        elif char.isspace():
            if mode == _NAME:
                raise _Failed(position)
            if mode == _KEY:
                self._mode = _EQUALS
        elif mode == _START:
            self._mode = _ITEM
        elif mode == _ITEM:
            if not _IDENTIFIER_START.match(char):
                raise _Failed(position)
            self._mode, self._word = _NAME, [char]
        elif mode == _NAME:
            if char != "(":
                raise _Failed(position)
            self._open_call(position)
            self._mode = _ARGS
        elif mode == _ARGS or mode == _AFTER_ARG:
            if char == ")":
                self._close_call()
                self._mode = _AFTER_CALL
            elif mode == _AFTER_ARG and char == ",":
                self._mode = _ARGS
            elif mode == _ARGS and _IDENTIFIER_START.match(char):
                self._mode, self._word = _KEY, [char]
            else:
                raise _Failed(position)
        elif mode == _KEY or mode == _EQUALS:
            if char != "=":
                raise _Failed(position)
            self._key = "".join(self._word)
            self._mode, self._value, self._depth, self._quote, self._escape = _VALUE, [], 0, "", False
        elif mode == _AFTER_CALL:
            if char == ",":
                self._mode = _ITEM
            elif char == "]":
                self._mode, self._raw = _CONTENT, []
            else:
                raise _Failed(position)

    def _scan_value(self, text: str, position: int) -> int:
        """Read a literal value up to the "," or ")" that ends it at depth 0."""
        start = position
        while position < len(text):
            char = text[position]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = ""
                position += 1
                continue
            match = _VALUE_RUN.match(text, position)
            if match:
                position = match.end()
                continue
            if char in "'\"":
                self._quote = char
            elif char in _OPENERS:
                self._depth += 1
                if self._depth > _MAX_VALUE_DEPTH:
                    self._keep(text[start:position])
                    raise _Failed(position)
            elif self._depth:
                if char in _CLOSERS:
                    self._depth -= 1
            elif char in ",)":  # at depth 0: the value ends here
                self._value.append(text[start:position])
                self._keep(text[start:position])
                self._finish_value(position)
                self._mode = _AFTER_ARG
                return position  # the "," or ")" is read again in _AFTER_ARG
            else:  # an unbalanced "]" or "}"
                self._keep(text[start:position])
                raise _Failed(position)
            position += 1
        self._value.append(text[start:position])
        self._keep(text[start:position])
        return position

    def _fail(self, rest: str) -> None:
        """A malformed call: close it if it is out, else give its text back; the rest is content."""
        self.malformed_calls += 1
        if self._index is not None:
            self._arguments(self._index, "}" if self._fragments else "{}")
            self._content(rest)
        else:
            self._content("".join(self._raw) + rest)
        self._index, self._fragments, self._raw = None, [], []
        self._mode = _CONTENT

    def finish(self) -> list[Event]:
        if self._mode == _START:
            self._content("".join(self._raw))
        elif self._mode == _VALUE and self._index is not None:
            try:  # cut off inside the last value: keep it if it is complete
                self._finish_value(0)
                self._fail("")
            except _Failed:
                self._fail("")
        elif self._mode not in (_CONTENT, _AFTER_CALL):
            self._fail("")
        self._mode = _CONTENT
        return self._take_events()
