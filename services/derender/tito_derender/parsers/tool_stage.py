"""The tool-call stage of a choice: runs a ToolParser on the content (reasoning is never parsed
for tool calls) and tidies the whitespace around calls.

Whitespace at the end of the content is held until more content follows, so the blank lines a
model writes right before a call ("Let me check.\\n\\n<tool_call>...") or after the last one do
not reach the client as content of their own. If the choice makes no call, held whitespace is
released at the end and the content is exactly the text.
"""

from __future__ import annotations

from tito_derender.domain import OutputDelta
from tito_derender.parsers.tools.base import ToolParser


class ToolStage:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._held_whitespace = ""

    @property
    def calls_made(self) -> int:
        return self.parser.calls_made

    def process(self, delta: OutputDelta, *, final: bool) -> OutputDelta:
        events = self.parser.feed(delta.content) if delta.content else []
        if final:
            events += self.parser.finish()
        out = OutputDelta(reasoning_content=delta.reasoning_content, tool_calls=list(delta.tool_calls))
        for event in events:
            if isinstance(event, str):
                text = self._held_whitespace + event
                body = text.rstrip()
                self._held_whitespace = text[len(body):]
                out.content += body
            else:
                if event.name:  # a new call: the whitespace before it is dropped
                    self._held_whitespace = ""
                out.tool_calls.append(event)
        if final:
            if not self.parser.calls_made:
                out.content += self._held_whitespace
            self._held_whitespace = ""
        return out
