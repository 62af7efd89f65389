"""SMG's Generate stream shaped from the backend's outputs (domain values; the servicer makes them
messages).

Streamed (`stream` true): each output of a choice is one chunk, and its last is followed by the
choice's `complete`. Not streamed: one `complete` per choice, all at the end, each with the
choice's whole output (vLLM's FINAL_ONLY). A stop string (`stops.py`) ends its choice here: the
output is cut after the token that completed it and carries the matched string. The backend keeps
generating such a choice of an `n > 1` request until its other choices end (one choice of a
request cannot be aborted alone); its later tokens are dropped. Once every choice has ended the
stream ends, and the servicer closes the backend's stream, which aborts what is still running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from tito_engine.request import ChoiceOutput, FinishReason, Usage
from tito_engine.smg.stops import RequestStops, StopHit


@dataclass(frozen=True)
class FaceOutput:
    """One choice's tokens for the wire: since its previous message (streamed) or all of them."""

    output: ChoiceOutput
    matched_stop: str | None = None  # the stop string that ended the choice


def _cut(output: ChoiceOutput, hit: StopHit, prompt_tokens: int, cached_tokens: int) -> ChoiceOutput:
    # The backend's usage comes with its own last output only; a choice a stop string ended has
    # none yet, so its usage is made here, with the prefix-cache hit its first output reported.
    return ChoiceOutput(output.index, output.token_ids[:hit.kept], FinishReason.STOP, None,
                        Usage(prompt_tokens, hit.completion_tokens, cached_tokens), output.logprobs[:hit.kept],
                        output.timings)


async def face_outputs(outputs: AsyncIterator[ChoiceOutput], *, choices: int, stream: bool, prompt_tokens: int,
                       stops: RequestStops | None = None) -> AsyncIterator[FaceOutput]:
    """`outputs` as SMG's stream wants them (see the module docstring)."""
    ended: set[int] = set()
    merged: dict[int, ChoiceOutput] = {}
    matched: dict[int, str] = {}
    cached_tokens = 0  # the request's prefix-cache hit (every choice shares the prompt)
    async for output in outputs:
        if output.cached_tokens is not None:
            cached_tokens = max(cached_tokens, output.cached_tokens)
        if output.index in ended:
            continue  # a stop string ended it; the backend is still generating it
        if stops is not None and output.token_ids:
            hit = stops.feed(output.index, output.token_ids)
            if hit is not None:
                output = _cut(output, hit, prompt_tokens, cached_tokens)
                matched[output.index] = hit.stop
        if stream:
            yield FaceOutput(output, matched.get(output.index))
        else:
            previous = merged.get(output.index)
            merged[output.index] = output if previous is None else previous.merged_with(output)
        if output.finished:
            ended.add(output.index)
            if len(ended) == choices:
                break
    for index in sorted(merged):
        yield FaceOutput(merged[index], matched.get(index))
