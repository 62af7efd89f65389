"""Reasoning parsers: split `<think>…</think>` reasoning from the answer.

- "qwen3": output is content unless it starts (after whitespace) with `<think>`, or the prompt
  already opened the block (DerenderContext.prompt_opens_reasoning: e.g. the template ended the
  prompt with "<think>\\n"), in which case output starts as reasoning. `</think>` ends it.
- "deepseek_r1": output starts as reasoning until `</think>`, with or without a leading `<think>`.

The markers are dropped; the text around them is passed on unchanged. There is one reasoning
block: after `</think>` everything is content (a later "<think>" is just text). A choice that
ends inside the block (e.g. finish_reason length) has only reasoning. Thinking switched off
(thinking_enabled false) means no reasoning parser at all: everything is content.
"""

from __future__ import annotations

from tito_derender.domain import OutputDelta
from tito_derender.parsers.markers import split_at_marker

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser:
    """Per-choice `<think>` state; a Stage (see tito_derender.stream)."""

    def __init__(self, start_in_reasoning: bool) -> None:
        self._in_reasoning = start_in_reasoning
        # Until some non-whitespace text is out, a `<think>` may still open (or, already inside,
        # repeat) the block; such leading text waits.
        self._at_start = True
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def process(self, delta: OutputDelta, *, final: bool) -> OutputDelta:
        text = self._held + delta.content
        self._held = ""
        out = OutputDelta(reasoning_content=delta.reasoning_content, tool_calls=list(delta.tool_calls))
        if self._at_start and text:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self._in_reasoning = True
                self._at_start = False
                text = stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped) and not final:
                self._held = text  # whitespace and maybe the start of "<think>": wait
                return out
            elif stripped:
                self._at_start = False
        while text:
            if not self._in_reasoning:
                out.content += text
                break
            before, found, after = split_at_marker(text, THINK_END)
            out.reasoning_content += before
            if not found:
                if final:
                    out.reasoning_content += after
                else:
                    self._held = after
                break
            self._in_reasoning = False
            text = after
        return out

