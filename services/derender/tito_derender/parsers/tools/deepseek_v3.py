"""DeepSeek tool calls, both forms the models write (one parser reads either):

- V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>` (more calls, optionally after a newline) `<｜tool▁calls▁end｜>`;
- V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>`.

Text before the section is content, as is text after it. In the section, a broken call's markup
is content and the calls after it are still read. The markers are added tokens of the
DeepSeek tokenizers (not special ones, so the default skip_special_tokens keeps them).
"""

from __future__ import annotations

from tito_derender.parsers.tools.markup import WAIT, MarkupToolParser, ObjectArguments

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "```"


class DeepSeekV3ToolParser(MarkupToolParser):
    #: A call opened inside the reasoning may end it (see ToolParser.call_markers).
    call_markers = (CALLS_BEGIN, CALLS_END)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._fenced = False  # the V3 form: arguments inside a ```json fence
        self._name = ""

    def _content_state(self, text: str) -> str | None:
        return self._open(text, CALLS_BEGIN, self._section)

    def _section(self, text: str) -> str | None:
        return self._between_calls(text, CALL_BEGIN, self._call_header, CALLS_END)

    def _broken(self, text: str) -> str:
        """This call is none: its markup is content and the section goes on."""
        return self._break_call(text, CALL_END, self._section)

    def _call_header(self, text: str) -> str | None:
        split = self._header(text, SEP)
        if not split:
            return WAIT if split is None else self._broken(text)
        before, _, after = split
        kind = before.strip()
        self._fenced = kind == "function" and not after.lstrip().startswith("{")
        if self._fenced:
            self._state = self._v3_name
        else:
            self._name, self._state = kind, self._arguments_start
        return self._consume(text, len(text) - len(after))

    def _v3_name(self, text: str) -> str | None:
        split = self._header(text, "\n")
        if not split:
            return WAIT if split is None else self._broken(text)
        before, _, after = split
        self._name = before.strip()
        self._state = self._v3_fence
        return self._consume(text, len(text) - len(after))

    def _v3_fence(self, text: str) -> str | None:
        return self._expect(text, {FENCE_OPEN: self._arguments_start}, otherwise=self._broken)

    def _arguments_start(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        if stripped[0] != "{" or not self._name:
            return self._broken(text)
        if not self.accept_name(self._name):
            return self._reject(text, CALL_END, self._section)
        text = self._consume(text, len(text) - len(stripped))
        self._call, self._state = ObjectArguments(self, self._name), self._object
        return text

    def _object(self, text: str) -> str | None:
        return self._feed_object(text, self._v3_fence_close if self._fenced else self._call_end, self._broken)

    def _v3_fence_close(self, text: str) -> str | None:
        return self._expect(text, {FENCE_CLOSE: self._call_end})

    def _call_end(self, text: str) -> str | None:
        return self._expect(text, {CALL_END: self._section})


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = DeepSeekV3ToolParser
