"""Per-request derender state: one `DerenderStream` per Derender call, one `ChoicePipeline` per
choice index (n > 1 choices arrive multiplexed by `GenerateResponse.index`).

Each choice runs its text through stages:

    detokenize -> [stop strings] -> [reasoning parser] -> [tool-call parser] -> chunk

Phase 1 has the detokenizer and the chunk builder; the middle stages plug into
`ChoicePipeline.stages` (objects with `process(delta, final=...) -> OutputDelta`) without
changing the state machine. All work per engine message is proportional to its new tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from tito.errors import FailedPrecondition, InvalidArgument
from tito_derender.chunks import ChunkBuilder
from tito_derender.detokenizer import IncrementalDetokenizer
from tito_derender.domain import Chunk, EngineOutput, FinishReason, OutputDelta, RequestContext, Usage
from tito_derender.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class Stage(Protocol):
    """A text stage between the detokenizer and the chunk builder (stop strings, parsers).

    `process` gets the newly final text of a choice and returns what to pass on; with
    `final=True` (the choice's last message) it must release anything it held back.
    """

    def process(self, delta: OutputDelta, *, final: bool) -> OutputDelta: ...


_warned_unapplied: set[str] = set()


def stages_for(context: RequestContext) -> list[Stage]:
    """The text stages a choice of this request runs, in order (stop strings, reasoning parser,
    tool-call parser). None exist yet: requests that ask for them get plain content, and the
    operator a one-time warning."""
    asked = [name for name, wanted in (("stop strings", bool(context.stop)),
                                       (f"reasoning parser {context.reasoning_parser!r}", bool(context.reasoning_parser)),
                                       (f"tool parser {context.tool_parser!r}", bool(context.tool_parser)),
                                       ("logprobs text", context.logprobs)) if wanted]
    for name in asked:
        if name not in _warned_unapplied:
            _warned_unapplied.add(name)
            log.warning("%s requested but not applied by this derender version: output is plain content", name)
    return []


class ChoicePipeline:
    """The state of one choice: detokenizer, stages, chunk state, token count."""

    def __init__(self, index: int, tokenizer: TextTokenizer, context: RequestContext,
                 stages: Sequence[Stage] = ()) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._context = context
        self._detokenizer = IncrementalDetokenizer(tokenizer, context.text, context.prompt_tail_token_ids)
        self.stages: list[Stage] = list(stages)
        self._chunks = ChunkBuilder(index)
        self.completion_tokens = 0
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.matched_stop = ""

    def _run_stages(self, text: str, final: bool) -> OutputDelta:
        delta = OutputDelta(content=text)
        for stage in self.stages:
            delta = stage.process(delta, final=final)
        return delta

    def feed(self, output: EngineOutput) -> tuple[OutputDelta, bool]:
        """Detokenize and run the stages; returns the delta and whether this ended the choice."""
        self.completion_tokens += len(output.token_ids)
        text_ids = output.token_ids
        stopped_by_token = output.matched_stop_token_id is not None
        if (stopped_by_token and text_ids and text_ids[-1] == output.matched_stop_token_id
                and not self._context.include_stop_str_in_output):
            # The stop token is reported as matched_stop, not repeated in the content.
            text_ids = text_ids[:-1]
        text = self._detokenizer.add(text_ids)
        final = output.finish_reason is not None
        if final:
            text += self._detokenizer.flush()
            self.finished = True
            self.finish_reason = output.finish_reason
            if stopped_by_token:
                self.matched_stop = self._tokenizer.token_text(output.matched_stop_token_id)
        return self._run_stages(text, final), final

    def content_chunk(self, delta: OutputDelta) -> Chunk | None:
        return self._chunks.delta(delta)

    def final_chunk(self, delta: OutputDelta, usage: Usage) -> Chunk:
        return self._chunks.final(delta, self.finish_reason, self.matched_stop, usage)


class DerenderStream:
    """One request's derender state machine. Build it from the context, then `feed` each engine
    output; it returns the chunks to send. Raises InvalidArgument naming the offending field."""

    def __init__(self, tokenizer: TextTokenizer, context: RequestContext) -> None:
        self._tokenizer = tokenizer
        for position, token_id in enumerate(context.prompt_tail_token_ids):
            if token_id >= tokenizer.vocab_size:
                raise InvalidArgument(
                    f"prompt tail token id {token_id} is outside the vocabulary [0, {tokenizer.vocab_size})",
                    reason="TOKEN_ID_OUT_OF_RANGE", field=f"context.prompt_tail_token_ids[{position}]")
        self.context = context
        self.n = max(context.n, 1)  # proto3 zero: a context that does not say means one choice
        self._choices: dict[int, ChoicePipeline] = {}
        self._prompt_tokens = context.prompt_tokens
        self._cached_tokens = 0
        self._completion_tokens_finished = 0

    def choice(self, index: int) -> ChoicePipeline:
        pipeline = self._choices.get(index)
        if pipeline is None:
            pipeline = self._choices[index] = ChoicePipeline(index, self._tokenizer, self.context,
                                                             stages_for(self.context))
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
        if existing is not None and existing.finished:
            raise FailedPrecondition(
                f"choice {output.index} already finished; an engine response after the final one is a "
                f"caller bug", reason="CHOICE_ALREADY_FINISHED", field="generate_response.index")
        vocab = self._tokenizer.vocab_size
        for position, token_id in enumerate(output.token_ids):
            if token_id >= vocab:
                raise InvalidArgument(
                    f"token id {token_id} is outside the vocabulary [0, {vocab})",
                    reason="TOKEN_ID_OUT_OF_RANGE", field=f"generate_response.token_ids[{position}]")
        if output.matched_stop_token_id is not None and output.matched_stop_token_id >= vocab:
            raise InvalidArgument(
                f"matched stop token id {output.matched_stop_token_id} is outside the vocabulary [0, {vocab})",
                reason="TOKEN_ID_OUT_OF_RANGE", field="generate_response.matched_stop_token_id")

    def feed(self, output: EngineOutput) -> list[Chunk]:
        """Take one engine output; return the chunks it makes final (zero or more)."""
        self._validate(output)
        pipeline = self.choice(output.index)
        delta, final = pipeline.feed(output)
        if not final:
            chunk = pipeline.content_chunk(delta)
            return [chunk] if chunk is not None else []
        completion = pipeline.completion_tokens
        if output.usage is not None:
            # The engine's count is authoritative (it may include tokens it did not stream).
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
        log.debug("choice %d finished: %s after %d tokens", output.index, pipeline.finish_reason.value,
                  completion)
        return [pipeline.final_chunk(delta, usage)]

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self._prompt_tokens, completion_tokens=self._completion_tokens_finished,
                     cached_tokens=self._cached_tokens)
