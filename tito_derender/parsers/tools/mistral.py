"""Mistral tool calls: `[TOOL_CALLS]` followed by a JSON array of {"name", "arguments"} objects
(a single bare object is accepted too). Text before the marker is content, as is text after the
array. `[TOOL_CALLS]` is a special token in Mistral tokenizers: the request needs
skip_special_tokens false for it to reach derender's text.
"""

from __future__ import annotations

from tito_derender.parsers.tools.base import DONE, FAILED, Event, JsonCall, ToolParser

MARKER = "[TOOL_CALLS]"

_CONTENT, _OPEN, _ELEMENT, _CALL, _SEPARATOR = range(5)


class MistralToolParser(ToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _CONTENT
        self._held = ""
        self._raw_prefix = ""  # the marker and array text before the current call, for a failure
        self._in_array = False
        self._call: JsonCall | None = None

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
                continue
            stripped = text.lstrip()
            if self._mode != _CALL:
                self._raw_prefix += text[:len(text) - len(stripped)]
                if not stripped:
                    break
                text = stripped
            if self._mode == _OPEN:
                if text[0] == "[":
                    self._mode, self._in_array, self._raw_prefix = _ELEMENT, True, self._raw_prefix + "["
                    text = text[1:]
                elif text[0] == "{":
                    self._mode, self._in_array, self._call = _CALL, False, JsonCall(self)
                else:
                    self._give_up()
            elif self._mode == _ELEMENT:
                if text[0] == "{":
                    self._mode, self._call = _CALL, JsonCall(self)
                elif text[0] == "]" and self.calls_made:
                    self._mode, text = _CONTENT, text[1:]
                else:
                    self._give_up()
            elif self._mode == _CALL:
                consumed = self._call.feed(text)
                text = text[consumed:]
                if self._call.status == FAILED:
                    self._fail_call()
                elif self._call.status == DONE:
                    self._raw_prefix = ""
                    self._mode = _SEPARATOR if self._in_array else _CONTENT
            else:  # _SEPARATOR
                if text[0] == ",":
                    self._mode, text = _ELEMENT, text[1:]
                elif text[0] == "]":
                    self._mode, text = _CONTENT, text[1:]
                else:
                    self._mode = _CONTENT  # a missing "]": the rest is content
        return self._take_events()

    def _give_up(self) -> None:
        """Not a call list after all: the consumed markup is content; read on as content."""
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
        elif self._mode in (_OPEN, _ELEMENT):
            self._give_up()
        elif self._mode == _CONTENT:
            self._content(self._held)
        self._held = ""
        self._mode = _CONTENT
        return self._take_events()
