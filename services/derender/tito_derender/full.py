"""DerenderFull: a whole engine output to one chat completion, by running the same stream state
machine and concatenating each choice's chunks (so streaming and non-streaming never disagree).

The one difference: tool calls are parsed in non-streaming mode, so a call appears only once its
markup is complete and valid; anything malformed stays content (a stream, which must send a
call's name before its end is known, closes a broken call's arguments instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tito.errors import FailedPrecondition, InvalidArgument
from tito_derender.domain import EngineOutput, FinishReason, RequestContext, TokenLogprobText, ToolCallDelta, Usage
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer


@dataclass
class CompletedToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class CompletedChoice:
    index: int
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[CompletedToolCall] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    logprobs: list[TokenLogprobText] = field(default_factory=list)

    def add_tool_delta(self, delta: ToolCallDelta) -> None:
        if delta.name:
            self.tool_calls.append(CompletedToolCall(id=delta.id, name=delta.name))
        self.tool_calls[delta.index].arguments += delta.arguments


def derender_full(tokenizer: TextTokenizer, context: RequestContext, outputs: Iterable[EngineOutput],
                  on_done: Callable[[DerenderStream], None] | None = None) -> tuple[list[CompletedChoice], Usage]:
    """`on_done` (metrics) sees the finished stream: its choices and parser outcomes."""
    stream = DerenderStream(tokenizer, context, streaming=False)
    choices = {index: CompletedChoice(index) for index in range(stream.n)}
    for position, output in enumerate(outputs):
        try:
            chunks = stream.feed(output)
        except (InvalidArgument, FailedPrecondition) as error:
            # Name the response too: "responses[3].token_ids[0]" instead of "generate_response...".
            # A stream's out-of-order message is a state problem (FAILED_PRECONDITION); here the
            # whole output arrives in one request, so any inconsistency is a malformed request.
            raise InvalidArgument(error.message, reason=error.reason,
                                  field=(error.field or "").replace("generate_response", f"responses[{position}]", 1)
                                  ) from None
        for chunk in chunks:
            choice = choices[chunk.index]
            choice.content += chunk.content
            choice.reasoning_content += chunk.reasoning_content
            for delta in chunk.tool_calls:
                choice.add_tool_delta(delta)
            choice.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                choice.finish_reason = chunk.finish_reason
                choice.matched_stop = chunk.matched_stop
    unfinished = stream.unfinished_choices
    if unfinished:
        raise InvalidArgument(
            f"choice {unfinished[0]} has no final response (one with finish_reason set); DerenderFull needs "
            f"the whole engine output of all {stream.n} choices", reason="INCOMPLETE_OUTPUT", field="responses")
    if on_done is not None:
        on_done(stream)
    return [choices[i] for i in range(stream.n)], stream.usage()
