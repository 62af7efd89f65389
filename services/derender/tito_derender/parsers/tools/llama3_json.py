"""Llama 3 JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
possibly after `<|python_tag|>`, several separated by `;`.

Like vLLM, calls are recognised only at the start of the output (after whitespace): an output
that starts with anything else is plain content throughout. Text after the last call is content.
If the first object is not a call (no name, malformed) the whole output is content.
"""

from __future__ import annotations

from tito_derender.parsers.tools.base import DONE, FAILED, Event, JsonCall, ToolParser

PYTHON_TAG = "<|python_tag|>"

_START, _CALL, _SEPARATOR, _NEXT, _CONTENT = range(5)


class Llama3JsonToolParser(ToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _START
        self._held = ""  # leading text (whitespace, the python tag) until the first call shows
        self._call: JsonCall | None = None

    def feed(self, text: str) -> list[Event]:
        while text:
            if self._mode == _CONTENT:
                self._content(text)
                break
            if self._mode == _START:
                held = self._held + text
                stripped = held.lstrip()
                if stripped.startswith(PYTHON_TAG):
                    stripped = stripped[len(PYTHON_TAG):].lstrip()
                    if not stripped:
                        self._held = held
                        break
                if not stripped or PYTHON_TAG.startswith(stripped):
                    self._held = held
                    break
                if stripped[0] != "{":
                    self._mode, self._held = _CONTENT, ""
                    self._content(held)
                    break
                self._mode, self._call = _CALL, JsonCall(self)
                text = stripped  # self._held keeps the leading text in case the call fails
            elif self._mode == _CALL:
                consumed = self._call.feed(text)
                text = text[consumed:]
                if self._call.status == FAILED:
                    self._fail_call()
                elif self._call.status == DONE:
                    self._mode, self._held = _SEPARATOR, ""
            else:  # _SEPARATOR (after a call: whitespace, then ";" or the next call) or _NEXT (after ";")
                stripped = text.lstrip()
                if not stripped:
                    break
                if stripped[0] == ";" and self._mode == _SEPARATOR:
                    self._mode, text = _NEXT, stripped[1:]
                elif stripped[0] == "{":
                    self._mode, self._call, text = _CALL, JsonCall(self), stripped
                else:
                    self._mode, text = _CONTENT, stripped
        return self._take_events()

    def _fail_call(self) -> None:
        name_sent = self._call.name_sent
        raw = self._call.fail()
        if not name_sent:
            raw = self._held + raw
        self._held = ""
        self._content(raw)
        self._mode = _CONTENT

    def finish(self) -> list[Event]:
        if self._mode == _CALL:
            self._fail_call()
        elif self._mode == _START:
            self._content(self._held)
        self._held = ""
        self._mode = _CONTENT
        return self._take_events()


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = Llama3JsonToolParser
