"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, with content around them."""

from __future__ import annotations

from tito_derender.parsers.markers import partial_marker_length
from tito_derender.parsers.tools.base import DONE, FAILED, Event, JsonCall, ToolParser

START = "<tool_call>"
END = "</tool_call>"

_CONTENT, _CALL, _AFTER_CALL = range(3)


class HermesToolParser(ToolParser):
    call_markers = (START, END)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _CONTENT
        self._held = ""
        self._call: JsonCall | None = None

    def feed(self, text: str) -> list[Event]:
        text = self._held + text
        self._held = ""
        while text:
            if self._mode == _CONTENT:
                rest = self._content_until(text, START)
                if rest is None:
                    break
                self._mode, self._call = _CALL, JsonCall(self)
                text = rest
            elif self._mode == _CALL:
                consumed = self._call.feed(text)
                text = text[consumed:]
                if self._call.status == FAILED:
                    self._fail_call()
                    self._mode = _CONTENT  # the offending text is read again as content
                elif self._call.status == DONE:
                    self._mode = _AFTER_CALL
            else:  # after a call's JSON: whitespace, then </tool_call> (or, if forgotten, the next call)
                end, start = text.find(END), text.find(START)
                if end < 0 and start < 0:
                    keep = max(partial_marker_length(text, END), partial_marker_length(text, START))
                    self._content(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                if end >= 0 and (start < 0 or end < start):
                    self._content(text[:end])
                    text = text[end + len(END):]
                else:
                    self._content(text[:start])
                    text = text[start:]
                self._mode = _CONTENT
        return self._take_events()

    def _fail_call(self) -> None:
        name_sent = self._call.name_sent
        raw = self._call.fail()
        self._content(raw if name_sent else START + raw)

    def finish(self) -> list[Event]:
        if self._mode == _CALL:
            self._fail_call()
        elif self._mode == _CONTENT:
            self._content(self._held)
        elif self._held.strip():
            self._content(self._held)
        self._held = ""
        self._mode = _CONTENT
        return self._take_events()


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = HermesToolParser
