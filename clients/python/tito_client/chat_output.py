"""How `tito chat` prints a streamed answer: reasoning as a dimmed "thinking:" section, then the
content, each tool call on its own "tool call: name(arguments)" line, then the finish line.

Streams arrive in fragments (a reasoning chunk, content chunks, a tool call's name and then its
argument pieces), so the printer keeps which section is open and starts a new line when the section
changes. Leading newlines of a section (the template's "\\n" after <think>, "\\n\\n" before the
answer) are dropped: they are markup spacing, not text.
"""

from __future__ import annotations

from typing import TextIO

DIM, RESET = "\033[2m", "\033[0m"
THINKING, CONTENT, TOOL_CALL = "thinking", "content", "tool call"


class ChatPrinter:
    """Prints one choice's ChatChunks to `out` as they arrive; `color` dims the reasoning."""

    def __init__(self, out: TextIO, color: bool = False) -> None:
        self.out = out
        self.color = color
        self.section = ""  # the open section: "", THINKING, CONTENT or TOOL_CALL
        self.pending_newlines = ""  # trailing newlines held back until more text follows

    def chunk(self, chunk) -> None:
        if chunk.reasoning_content:
            self._text(THINKING, chunk.reasoning_content)
        if chunk.content:
            self._text(CONTENT, chunk.content)
        for call in chunk.tool_calls:
            if call.name:
                self._open(TOOL_CALL)
                self._write(f"tool call: {call.name}(")
            if call.arguments:
                self._write(call.arguments)
        if chunk.finish_reason:
            self.finish(chunk)

    def finish(self, chunk) -> None:
        from tito.v1 import engine_pb2

        self._close()
        usage = chunk.usage
        self._write(f"\n[finish_reason={engine_pb2.FinishReason.Name(chunk.finish_reason)} "
                    f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}]\n")
        self.section = ""

    def _text(self, section: str, text: str) -> None:
        if self.section != section:
            text = text.lstrip("\n")
            if not text:
                return
            self._open(section)
            if section == THINKING:
                self._write((DIM if self.color else "") + "thinking: ")
        body = text.rstrip("\n")
        if body:
            self._write(self.pending_newlines + body)
            self.pending_newlines = ""
        self.pending_newlines += text[len(body):]

    def _open(self, section: str) -> None:
        if self.section:
            self._close()
            self._write("\n")
        self.section = section

    def _close(self) -> None:
        if self.section == THINKING and self.color:
            self._write(RESET)
        elif self.section == TOOL_CALL:
            self._write(")")
        self.pending_newlines = ""

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
