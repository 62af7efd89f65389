"""The "gpt_oss" reasoning parser: GPT-OSS writes harmony messages, each a header and a body,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>

(the prompt ends with `<|start|>assistant`, so the output opens with the first message's
channel). By channel: `analysis` bodies are reasoning; a message with a function recipient
(`to=functions.NAME`, a tool call) passes on verbatim, header and all, as content for the
"gpt_oss" tool parser; any other body (`final`, a `commentary` preamble) is content, its header
dropped. `<|end|>`, `<|return|>` and `<|call|>` end a body (as does a new `<|start|>`); the
end markers and headers are not part of any text, not even a header the output ends inside
(`<|start|>assistant<|channel|>fin` at finish length). Output that does not open with a header
(e.g. special tokens skipped, so no markers reach derender) is content throughout.
"""

from __future__ import annotations

import re

from tito_derender.domain import OutputDelta
from tito_derender.parsers.markers import partial_marker_length

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
#: Longest header read before deciding the output is not harmony after all.
MAX_HEADER_CHARS = 512
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=\S")

_HEADER, _REASONING, _CONTENT, _CALL, _PLAIN = range(5)


class HarmonyReasoningParser:
    """Per-choice harmony state; a Stage (see tito_derender.stream)."""

    def __init__(self) -> None:
        self._mode = _HEADER
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._mode == _REASONING

    def process(self, delta: OutputDelta, *, final: bool) -> OutputDelta:
        text = self._held + delta.content
        self._held = ""
        out = OutputDelta(reasoning_content=delta.reasoning_content, tool_calls=list(delta.tool_calls))
        while text:
            if self._mode == _PLAIN:
                out.content += text
                break
            if self._mode == _HEADER:
                text = self._read_header(text, out, final)
            else:
                text = self._read_body(text, out, final)
        return out

    def _read_header(self, text: str, out: OutputDelta, final: bool) -> str:
        stripped = text.lstrip()
        if (not stripped or stripped == "<") and not final:
            self._held = text  # whitespace, or maybe the start of a header: wait
            return ""
        if not stripped.startswith("<|"):
            self._mode = _PLAIN  # not harmony: everything is content
            return text
        position = text.find(MESSAGE)
        if position < 0:
            if len(text) > MAX_HEADER_CHARS:
                self._mode = _PLAIN
                return text
            if not final:
                self._held = text
            # else: the output ended inside a header (finish length): no header is text
            return ""
        header = text[:position]
        channel = _CHANNEL_NAME.search(header)
        if _RECIPIENT.search(header):
            self._mode = _CALL
            out.content += header.lstrip() + MESSAGE
        elif channel and channel.group(1) == "analysis":
            self._mode = _REASONING
        else:
            self._mode = _CONTENT
        return text[position + len(MESSAGE):]

    def _read_body(self, text: str, out: OutputDelta, final: bool) -> str:
        ends = [(text.find(marker), marker) for marker in BODY_ENDS if marker in text]
        if ends:
            position, marker = min(ends)
            body, rest = text[:position], text[position + len(marker):]
            if marker == START:
                rest = text[position:]  # the next header starts here
        else:
            keep = 0 if final else max(partial_marker_length(text, marker) for marker in BODY_ENDS)
            body, rest = text[:len(text) - keep], ""
            self._held = text[len(text) - keep:]
        if self._mode == _REASONING:
            out.reasoning_content += body
        else:
            out.content += body
        if ends:
            if self._mode == _CALL and marker != START:
                out.content += marker
            self._mode = _HEADER
        return rest
