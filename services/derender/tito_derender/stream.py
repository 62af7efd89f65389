"""Per-request derender state: one `DerenderStream` per Derender call, one `ChoicePipeline` per
choice index (n > 1 choices arrive multiplexed by `GenerateResponse.index`, each with its own
state).

Each choice runs its text through:

    detokenize -> stop strings -> [reasoning parser] -> [tool-call parser] -> chunk

Stop strings see the whole output text (reasoning included, as in vLLM) and can end the choice
before the engine does: the final chunk then says finish_reason stop and matched_stop the string,
and later engine messages for that choice are ignored. cancel_generation is set on the final
chunk that leaves no choice unfinished while the engine still generates a stopped one (the stop
chunk itself when n = 1), because cancelling the engine stream ends all of its choices. The parsers
are `Stage`s (`process(delta, final=...) -> OutputDelta`). All work per engine message is
proportional to its new tokens (plus bounded look-behind for markers and stop strings).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from tito.errors import FailedPrecondition, InvalidArgument
from tito_derender.chunks import ChunkBuilder
from tito_derender.detokenizer import IncrementalDetokenizer
from tito_derender.domain import (
    Chunk, EngineOutput, FinishReason, OutputDelta, PositionLogprobs, RequestContext, TokenLogprobText,
    ToolChoiceMode, TopLogprobText, Usage)
from tito_derender.parsers import reasoning_parser_for, tool_stage_for, validate_parser_names
from tito.stop_strings import StopMatch, StopStringMatcher
from tito_derender.tokenizer import TextTokenizer

# Most choices one request may multiplex (render and the engine cap n lower still): state is kept
# per choice, so an unbounded n from a caller would be unbounded memory.
MAX_CHOICES = 128
# Usage counts are uint32 on the wire.
UINT32_MAX = 2**32 - 1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParserOutcomes:
    """Per request: tool calls parsed, calls whose malformed (or cut-off) markup went back to
    content, and choices whose reasoning was split from the content."""

    tool_calls: int = 0
    malformed_calls: int = 0
    reasoning_splits: int = 0


class Stage(Protocol):
    """A text stage between the stop strings and the chunk builder (the parsers).

    `process` gets the newly final text of a choice and returns what to pass on; with
    `final=True` (the choice's last text) it must release anything it held back.
    """

    def process(self, delta: OutputDelta, *, final: bool) -> OutputDelta: ...


class ChoicePipeline:
    """The state of one choice: detokenizer, stop strings, parser stages, chunk state, counts."""

    def __init__(self, index: int, tokenizer: TextTokenizer, context: RequestContext,
                 streaming: bool = True) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._context = context
        self._detokenizer = IncrementalDetokenizer(tokenizer, context.text, context.prompt_tail_token_ids)
        self._stops = (StopStringMatcher(context.stop, context.include_stop_str_in_output)
                       if context.stop else None)
        self._tools = tool_stage_for(context, streaming)
        reasoning = reasoning_parser_for(context, self._tools)
        self.stages: list[Stage] = [stage for stage in (reasoning, self._tools) if stage is not None]
        self._chunks = ChunkBuilder(index)
        self._logprobs: list[TokenLogprobText] = []  # waiting for the next chunk
        self.completion_tokens = 0
        self.finished = False
        #: Ended by a stop string: derender asked the caller to cancel; later messages are ignored.
        self.stopped_by_string = False
        self.finish_reason: FinishReason | None = None
        self.matched_stop = ""
        self.reasoning_split = False  # the reasoning parser took reasoning out of this choice's text

    def _run_stages(self, text: str, final: bool) -> OutputDelta:
        delta = OutputDelta(content=text)
        for stage in self.stages:
            delta = stage.process(delta, final=final)
        return delta

    def _logprob_text(self, position: PositionLogprobs) -> TokenLogprobText:
        tokenizer = self._tokenizer
        sampled = position.sampled
        return TokenLogprobText(
            token=tokenizer.token_text(sampled.token_id), token_id=sampled.token_id, logprob=sampled.logprob,
            bytes=tokenizer.token_bytes(sampled.token_id),
            top_logprobs=tuple(TopLogprobText(token=tokenizer.token_text(top.token_id), token_id=top.token_id,
                                              logprob=top.logprob, bytes=tokenizer.token_bytes(top.token_id))
                               for top in position.top))

    def feed(self, output: EngineOutput) -> tuple[OutputDelta, bool]:
        """Detokenize, match stop strings, run the stages; returns the delta and whether the
        choice ended (by the engine or by a stop string)."""
        self.completion_tokens += len(output.token_ids)
        self._logprobs.extend(self._logprob_text(position) for position in output.logprobs)
        text_ids = output.token_ids
        stopped_by_token = output.matched_stop_token_id is not None
        if (stopped_by_token and text_ids and text_ids[-1] == output.matched_stop_token_id
                and not self._context.include_stop_str_in_output):
            # The stop token is reported as matched_stop, not repeated in the content.
            text_ids = text_ids[:-1]
        text = self._detokenizer.add(text_ids)
        engine_final = output.finish_reason is not None
        if engine_final:
            text += self._detokenizer.flush()
        match = None
        if self._stops is not None:
            result = self._stops.feed(text)
            if isinstance(result, StopMatch):
                match, text = result, result.text
            else:
                text = result + (self._stops.flush() if engine_final else "")
        final = engine_final or match is not None
        delta = self._run_stages(text, final)
        if delta.reasoning_content:
            self.reasoning_split = True
        if final:
            self.finished = True
            if match is not None:
                self.finish_reason, self.matched_stop = FinishReason.STOP, match.stop
                self.stopped_by_string = not engine_final
            else:
                self.finish_reason = output.finish_reason
                if stopped_by_token:
                    self.matched_stop = self._tokenizer.token_text(output.matched_stop_token_id)
            if self._ended_by_calls():
                self.finish_reason = FinishReason.TOOL_CALLS
        return delta, final

    def _ended_by_calls(self) -> bool:
        """Whether the choice's finish reason is `tool_calls`: it stopped normally after calls the
        model chose to make (tool_choice auto or required). A call forced by a named tool_choice
        ends with `stop`, as OpenAI's API and vLLM's serving_chat end it."""
        return (self.finish_reason == FinishReason.STOP and self._tools is not None and self._tools.calls_made > 0
                and self._context.tool_choice != ToolChoiceMode.NAMED)

    @property
    def tool_parser(self):
        """The choice's ToolParser (its call counts), or None when tool calls are not parsed."""
        return self._tools.parser if self._tools is not None else None

    def content_chunk(self, delta: OutputDelta, usage: Usage | None = None) -> Chunk | None:
        chunk = self._chunks.delta(delta, tuple(self._logprobs), usage)
        if chunk is not None:
            self._logprobs.clear()
        return chunk

    def final_chunk(self, delta: OutputDelta, usage: Usage, cancel_generation: bool) -> Chunk:
        logprobs, self._logprobs = tuple(self._logprobs), []
        return self._chunks.final(delta, self.finish_reason, self.matched_stop, usage,
                                  cancel_generation=cancel_generation, logprobs=logprobs)


class DerenderStream:
    """One request's derender state machine. Build it from the context, then `feed` each engine
    output; it returns the chunks to send. Raises InvalidArgument naming the offending field."""

    def __init__(self, tokenizer: TextTokenizer, context: RequestContext, streaming: bool = True) -> None:
        self._tokenizer = tokenizer
        self._streaming = streaming
        validate_parser_names(context)
        for position, token_id in enumerate(context.prompt_tail_token_ids):
            if token_id >= tokenizer.vocab_size:
                raise InvalidArgument(
                    f"prompt tail token id {token_id} is outside the vocabulary [0, {tokenizer.vocab_size})",
                    reason="TOKEN_ID_OUT_OF_RANGE", field=f"context.prompt_tail_token_ids[{position}]")
        if context.n > MAX_CHOICES:
            raise InvalidArgument(f"n={context.n} choices is more than derender multiplexes (at most {MAX_CHOICES})",
                                  reason="TOO_MANY_CHOICES", field="context.n")
        self.context = context
        self.n = max(context.n, 1)  # proto3 zero: a context that does not say means one choice
        self._choices: dict[int, ChoicePipeline] = {}
        self._prompt_tokens = context.prompt_tokens
        self._cached_tokens = 0
        self._completion_tokens_finished = 0
        self._tokens_received = 0  # all choices: bounds every usage count derender sends

    def choice(self, index: int) -> ChoicePipeline:
        pipeline = self._choices.get(index)
        if pipeline is None:
            pipeline = self._choices[index] = ChoicePipeline(index, self._tokenizer, self.context,
                                                             self._streaming)
        return pipeline

    @property
    def finished(self) -> bool:
        """True once every expected choice has had its final message."""
        return len(self._choices) == self.n and all(c.finished for c in self._choices.values())

    @property
    def unfinished_choices(self) -> list[int]:
        return [i for i in range(self.n) if i not in self._choices or not self._choices[i].finished]

    def _validate(self, output: EngineOutput) -> None:
        if output.index >= self.n:
            raise InvalidArgument(
                f"choice index {output.index} is out of range: the context expects n={self.n} choices "
                f"(indices 0..{self.n - 1})", reason="CHOICE_INDEX_OUT_OF_RANGE", field="generate_response.index")
        existing = self._choices.get(output.index)
        if existing is not None and existing.finished and not existing.stopped_by_string:
            raise FailedPrecondition(
                f"choice {output.index} already finished; an engine response after the final one is a "
                f"caller bug", reason="CHOICE_ALREADY_FINISHED", field="generate_response.index")
        vocab = self._tokenizer.vocab_size
        if output.logprobs and len(output.logprobs) != len(output.token_ids):
            raise InvalidArgument(
                f"logprobs has {len(output.logprobs)} entries for {len(output.token_ids)} token ids: send one "
                f"per token id, or none", reason="LOGPROBS_MISMATCH", field="generate_response.logprobs")
        for position, entry in enumerate(output.logprobs):
            for name, token_id in (("sampled", entry.sampled.token_id),
                                   *((f"top[{k}]", top.token_id) for k, top in enumerate(entry.top))):
                if token_id >= vocab:
                    raise InvalidArgument(
                        f"logprob token id {token_id} is outside the vocabulary [0, {vocab})",
                        reason="TOKEN_ID_OUT_OF_RANGE",
                        field=f"generate_response.logprobs[{position}].{name}.token_id")
        for position, token_id in enumerate(output.token_ids):
            if token_id >= vocab:
                raise InvalidArgument(
                    f"token id {token_id} is outside the vocabulary [0, {vocab})",
                    reason="TOKEN_ID_OUT_OF_RANGE", field=f"generate_response.token_ids[{position}]")
        if output.matched_stop_token_id is not None and output.matched_stop_token_id >= vocab:
            raise InvalidArgument(
                f"matched stop token id {output.matched_stop_token_id} is outside the vocabulary [0, {vocab})",
                reason="TOKEN_ID_OUT_OF_RANGE", field="generate_response.matched_stop_token_id")
        if self._tokens_received + len(output.token_ids) > UINT32_MAX:
            raise InvalidArgument(
                f"the engine responses of this request hold more than {UINT32_MAX} token ids, more than usage "
                f"can count", reason="TOO_MANY_TOKENS", field="generate_response.token_ids")
        if output.usage is not None and output.finish_reason is not None and not (
                existing is not None and existing.stopped_by_string):
            self._validate_usage(output, existing)

    def _validate_usage(self, output: EngineOutput, existing: ChoicePipeline | None) -> None:
        """The engine's usage in a choice's final message must agree with what it streamed: it is
        what derender reports (and sums over choices), so an inflated count would be passed on as
        fact (and, summed, may not even fit the uint32 of ChatChunk.usage)."""
        usage = output.usage
        streamed = (existing.completion_tokens if existing is not None else 0) + len(output.token_ids)
        if usage.completion_tokens > streamed:
            raise InvalidArgument(
                f"usage.completion_tokens is {usage.completion_tokens}, but choice {output.index} streamed only "
                f"{streamed} tokens: the engine's count cannot exceed the tokens it sent",
                reason="USAGE_OUT_OF_RANGE", field="generate_response.usage.completion_tokens")
        prompt_tokens = usage.prompt_tokens or self._prompt_tokens
        if usage.cached_tokens > prompt_tokens:
            raise InvalidArgument(
                f"usage.cached_tokens is {usage.cached_tokens}, more than the {prompt_tokens} prompt tokens: "
                f"cached tokens are part of the prompt", reason="USAGE_OUT_OF_RANGE",
                field="generate_response.usage.cached_tokens")

    def feed(self, output: EngineOutput) -> list[Chunk]:
        """Take one engine output; return the chunks it makes final (zero or more)."""
        self._validate(output)
        self._tokens_received += len(output.token_ids)
        pipeline = self.choice(output.index)
        if pipeline.stopped_by_string:
            return []  # the engine had not seen the cancel yet: its later messages are ignored
        delta, final = pipeline.feed(output)
        if not final:
            chunk = pipeline.content_chunk(delta, self._choice_usage(pipeline))
            return [chunk] if chunk is not None else []
        completion = pipeline.completion_tokens
        if output.usage is not None and not pipeline.stopped_by_string:
            # The engine's count wins (validated: never more than the tokens it streamed).
            completion = output.usage.completion_tokens
            if output.usage.prompt_tokens:
                self._prompt_tokens = output.usage.prompt_tokens
            self._cached_tokens = max(self._cached_tokens, output.usage.cached_tokens)
        pipeline.completion_tokens = completion
        self._completion_tokens_finished += completion
        # Usage in a final chunk counts every choice finished so far, so the last final chunk
        # of the request carries the request's totals (Usage.completion_tokens: "all choices").
        usage = Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self._completion_tokens_finished,
                      cached_tokens=self._cached_tokens)
        log.debug("choice %d finished: %s after %d tokens%s", output.index, pipeline.finish_reason.value,
                  completion, " (stop string: caller asked to cancel)" if pipeline.stopped_by_string else "")
        return [pipeline.final_chunk(delta, usage, self._engine_work_is_unwanted())]

    def _choice_usage(self, pipeline: ChoicePipeline) -> Usage | None:
        """A content chunk's usage when every chunk carries it: the prompt and the choice's tokens so
        far (vLLM's continuous usage stats count the tokens generated, text held back or not)."""
        if not self.context.usage_in_every_chunk:
            return None
        return Usage(prompt_tokens=self._prompt_tokens, completion_tokens=pipeline.completion_tokens,
                     cached_tokens=self._cached_tokens)

    def _engine_work_is_unwanted(self) -> bool:
        """Whether this final chunk should ask the caller to cancel the engine stream: every
        choice is finished here, yet the engine is still generating one that a stop string ended.
        With n = 1 that is the stop string's chunk itself; with n > 1 the flag waits for the
        other choices, since cancelling the engine stream would cut them off too."""
        return self.finished and any(c.stopped_by_string for c in self._choices.values())

    def choices(self) -> list[ChoicePipeline]:
        """The choices seen so far, finished or not."""
        return list(self._choices.values())

    def parser_outcomes(self) -> ParserOutcomes:
        """What the parsers made of this request's choices so far (for metrics)."""
        choices = self._choices.values()
        tools = [choice.tool_parser for choice in choices if choice.tool_parser is not None]
        return ParserOutcomes(tool_calls=sum(parser.calls_made for parser in tools),
                              malformed_calls=sum(parser.malformed_calls for parser in tools),
                              reasoning_splits=sum(choice.reasoning_split for choice in choices))

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self._completion_tokens_finished,
                     cached_tokens=self._cached_tokens)
