"""Kimi-K2 tool calls: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>` ID
`<|tool_call_argument_begin|>` {...} `<|tool_call_end|>`, then `<|tool_calls_section_end|>`.

The ID is `functions.NAME:N` (N counts the calls of the conversation); the function name is
what lies between "functions." and the last ":". An ID that is only the counter (`0`) names no
function: the call is to the one tool the request accepts, and no call (its markup is content)
when there are several. The ID is the call's id (the chat template
renders it back into the conversation, and a tool result answers it). The markers are special
tokens: render keeps special tokens in the text for this parser (skip_special_tokens defaults to
false), else they never reach it.
"""

from __future__ import annotations

import re

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


class KimiK2ToolParser(MarkupToolParser):
    #: A call opened inside the reasoning may end it (see ToolParser.call_markers).
    call_markers = (SECTION_BEGIN, SECTION_END)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._call_id = ""
        self._name = ""

    def _content_state(self, text: str) -> str | None:
        return self._open(text, SECTION_BEGIN, self._section)

    def _section(self, text: str) -> str | None:
        return self._expect(text, {CALL_BEGIN: self._call_header, SECTION_END: self._content_state},
                            opening=(CALL_BEGIN,))

    def _call_header(self, text: str) -> str | None:
        split = self._header(text, ARGUMENT_BEGIN)
        if not split:
            return WAIT if split is None else self._give_up(text)
        before, _, after = split
        self._call_id = before.strip()
        if _BARE_COUNTER.fullmatch(self._call_id):
            self._name = self._only_function()
            if not self._name:  # which function is meant cannot be known: not a call
                return self._reject(text, CALL_END, self._section)
        else:
            self._name = function_name(self._call_id) or ""
        if not self._name:
            return self._give_up(text)
        if not self.accept_name(self._name):
            return self._reject(text, CALL_END, self._section)
        self._state = self._arguments_start
        return self._consume(text, len(text) - len(after))

    def _only_function(self) -> str:
        """The function a bare counter id calls: the one tool the request accepts (its only tool,
        or the one a named tool_choice names); "" when there are several (ambiguous)."""
        accepted = [name for name in sorted(self.tool_names) if self.accept_name(name)]
        return accepted[0] if len(accepted) == 1 else ""

    def _arguments_start(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        if stripped[0] != "{":
            return self._give_up(text)
        text = self._consume(text, len(text) - len(stripped))
        self._call, self._state = ObjectArguments(self, self._name, self._call_id), self._object
        return text

    def _object(self, text: str) -> str | None:
        return self._feed_object(text, self._call_end)

    def _call_end(self, text: str) -> str | None:
        return self._expect(text, {CALL_END: self._section})


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = KimiK2ToolParser
