"""GPT-OSS (harmony) tool calls: a message to a function recipient,

    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>

or with the recipient after the channel (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>`). The "gpt_oss" reasoning parser (parsers/harmony.py) passes such messages on
verbatim as content and strips the headers of the others; this parser turns them into calls.
Without that stage (no reasoning parser named) any other harmony message here is not a call and
stays content, header and all. `<|call|>` is a stop token, so the output may end right after the object.
The markers are special tokens: render keeps special tokens in the text for this parser.
"""

from __future__ import annotations

import re

from tito_derender.parsers.markers import partial_marker_length
from tito_derender.parsers.tools.markup import WAIT, MarkupToolParser, ObjectArguments

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CALL = "<|call|>"
END = "<|end|>"
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def recipient_function(header: str) -> str | None:
    """The function a message header addresses (`to=functions.NAME`), None for other messages."""
    match = _RECIPIENT.search(header)
    return match.group(1) if match else None


class GptOssToolParser(MarkupToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._name = ""

    def _content_state(self, text: str) -> str | None:
        starts = [(text.find(marker), marker) for marker in (START, CHANNEL) if marker in text]
        if not starts:
            keep = max(partial_marker_length(text, START), partial_marker_length(text, CHANNEL))
            self._content(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return ""
        position, marker = min(starts)
        self._content(text[:position])
        self._raw, self._call, self._closing, self._state = marker, None, False, self._header_state
        return text[position + len(marker):]

    def _header_state(self, text: str) -> str | None:
        split = self._header(text, MESSAGE)
        if not split:
            return WAIT if split is None else self._give_up(text)
        header, _, after = split
        self._name = recipient_function(header) or ""
        if not self._name or not self.accept_name(self._name):
            return self._give_up(text)
        self._state = self._arguments_start
        return self._consume(text, len(text) - len(after))

    def _arguments_start(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        if stripped[0] != "{":
            return self._give_up(text)
        text = self._consume(text, len(text) - len(stripped))
        self._call, self._state = ObjectArguments(self, self._name), self._object
        return text

    def _object(self, text: str) -> str | None:
        return self._feed_object(text, self._message_end)

    def _message_end(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        for marker in (CALL, END):
            if stripped.startswith(marker):
                self._state = self._content_state
                return stripped[len(marker):]
        if CALL.startswith(stripped) or END.startswith(stripped):
            return WAIT
        self._state = self._content_state
        return stripped


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = GptOssToolParser
