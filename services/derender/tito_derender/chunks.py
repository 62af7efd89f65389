"""Turning a choice's pipeline output into chat chunks: the OpenAI streaming conventions.

- the first chunk of each choice carries role "assistant";
- a chunk is sent only when it carries something, except the final one, which always goes out
  with the finish reason, the matched stop and usage.
"""

from __future__ import annotations

from tito_derender.domain import Chunk, FinishReason, OutputDelta, TokenLogprobText, Usage

ASSISTANT = "assistant"


class ChunkBuilder:
    """Per-choice chunk state: whether the role has been sent yet."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._role_sent = False

    def _role(self) -> str:
        if self._role_sent:
            return ""
        self._role_sent = True
        return ASSISTANT

    def delta(self, delta: OutputDelta, logprobs: tuple[TokenLogprobText, ...] = (),
              usage: Usage | None = None) -> Chunk | None:
        """A content chunk, or None when the delta is empty (nothing worth a message; logprobs of
        tokens whose text is still held back wait for the chunk that carries it). `usage`: the
        choice's so far, when every chunk carries it."""
        if delta.is_empty():
            return None
        return Chunk(index=self.index, role=self._role(), content=delta.content,
                     reasoning_content=delta.reasoning_content, tool_calls=tuple(delta.tool_calls),
                     logprobs=logprobs, usage=usage)

    def final(self, delta: OutputDelta, finish_reason: FinishReason, matched_stop: str, usage: Usage,
              cancel_generation: bool = False, logprobs: tuple[TokenLogprobText, ...] = ()) -> Chunk:
        """The last chunk of the choice: always sent, with whatever text was still pending."""
        return Chunk(index=self.index, role=self._role(), content=delta.content,
                     reasoning_content=delta.reasoning_content, tool_calls=tuple(delta.tool_calls),
                     finish_reason=finish_reason, matched_stop=matched_stop, usage=usage,
                     cancel_generation=cancel_generation, logprobs=logprobs)
