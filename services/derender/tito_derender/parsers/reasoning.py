"""Reasoning parsers: split `<think>…</think>` reasoning from the answer.

- "qwen3": output is content unless it starts (after whitespace) with `<think>`, or the prompt
  already opened the block (DerenderContext.prompt_opens_reasoning: e.g. the template ended the
  prompt with "<think>\\n"), in which case output starts as reasoning. `</think>` ends it.
- "deepseek_r1": output starts as reasoning until `</think>`, with or without a leading `<think>`.

A tool call can end the block too. Qwen3 models sometimes open a call without writing `</think>`
first, and the call would be lost inside the reasoning. So when tool calls are parsed and the
tool parser declares its call markers (hermes, qwen3_coder, glm45: `<tool_call>` ... `</tool_call>`;
deepseek_v3, kimi_k2: their calls section), a call that
starts inside the reasoning is held back until it is clear what it is:
- `</think>` comes (inside the call or after it), or other text follows the call: the model was
  thinking about a call; the held text is reasoning, as before.
- the choice ends after the call (or after several calls, separated by whitespace only): the
  reasoning ended where the first call started; the calls, as written, are content and the tool
  stage parses them.
A hold lasts at most one call's text (plus further calls right after it), and the result does
not depend on how the text is split.

The think markers are dropped; the text around them is passed on unchanged. There is one reasoning
block: after `</think>` everything is content (a later "<think>" is just text). A choice that
ends inside the block (e.g. finish_reason length) has only reasoning. Thinking switched off
(thinking_enabled false) means no reasoning parser at all: everything is content.
"""

from __future__ import annotations

from tito_derender.domain import OutputDelta
from tito_derender.parsers.markers import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser:
    """Per-choice `<think>` state; a Stage (see tito_derender.stream)."""

    def __init__(self, start_in_reasoning: bool, call_markers: tuple[str, str] | None = None) -> None:
        self._in_reasoning = start_in_reasoning
        #: (start, end) of the tool parser's calls, when tool calls are parsed.
        self._call_markers = call_markers
        #: A call that started inside the reasoning, held back (see the module docstring).
        self._candidate: list[str] | None = None
        self._candidate_closed = False  # its end marker was read: whitespace or another call may follow
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
            if self._candidate is not None:
                text = self._read_candidate(text, out)
                continue
            text = self._read_reasoning(text, out)
        if final:
            self._end(out)
        return out

    def _read_reasoning(self, text: str, out: OutputDelta) -> str:
        """Reasoning text up to `</think>` or a call start; returns what is left to read."""
        markers = (THINK_END, self._call_markers[0]) if self._call_markers else (THINK_END,)
        found = [(position, marker) for marker in markers if (position := text.find(marker)) >= 0]
        if not found:
            keep = max(partial_marker_length(text, marker) for marker in markers)
            out.reasoning_content += text[:len(text) - keep]
            self._held = text[len(text) - keep:]
            return ""
        position, marker = min(found)
        out.reasoning_content += text[:position]
        if marker == THINK_END:
            self._in_reasoning = False
        else:
            self._candidate, self._candidate_closed = [marker], False
        return text[position + len(marker):]

    def _read_candidate(self, text: str, out: OutputDelta) -> str:
        """Inside or right after a held call; returns what is left to read."""
        start, end = self._call_markers
        if not self._candidate_closed:
            found = [(position, marker) for marker in (THINK_END, end) if (position := text.find(marker)) >= 0]
            if not found:
                keep = max(partial_marker_length(text, THINK_END), partial_marker_length(text, end))
                self._candidate.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return ""
            position, marker = min(found)
            if marker == THINK_END:  # a call the model was thinking about
                self._release(out, text[:position])
                self._in_reasoning = False
            else:
                self._candidate.append(text[:position + len(marker)])
                self._candidate_closed = True
            return text[position + len(marker):]
        stripped = text.lstrip()
        self._candidate.append(text[:len(text) - len(stripped)])
        if stripped.startswith(start):
            self._candidate.append(start)
            self._candidate_closed = False
            return stripped[len(start):]
        if not stripped or (start.startswith(stripped) and len(stripped) < len(start)):
            self._held = stripped  # whitespace, or maybe the start of another call: wait
            return ""
        self._release(out, "")  # text after the call: it was part of the reasoning
        return stripped

    def _release(self, out: OutputDelta, more: str) -> None:
        out.reasoning_content += "".join(self._candidate) + more
        self._candidate = None

    def _end(self, out: OutputDelta) -> None:
        """The choice ended: a held call ended the reasoning (content); held text is flushed."""
        held, self._held = self._held, ""
        if self._candidate is not None:
            out.content += "".join(self._candidate) + held
            self._candidate, self._in_reasoning = None, False
        elif self._in_reasoning:
            out.reasoning_content += held
        else:
            out.content += held

