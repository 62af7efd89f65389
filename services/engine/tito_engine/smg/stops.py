"""Stop strings in the engine, for SMG's face.

SMG sends a request's stop strings to the worker, and vLLM's engine ends a choice on them, so this
face does too (tito.v1 leaves stop strings to derender). Each choice's tokens are detokenized as
they arrive with `tokenizers`' DecodeStream (the incremental decoder vLLM's fast detokenizer uses,
seeded with the prompt's last tokens so the first token's leading space is right) and matched with
the matcher derender uses (`tito.stop_strings`). A choice ends at the token whose text completes a
stop string; its token ids are kept up to and including that token (vLLM keeps the ids too, and
SMG cuts the text itself). As in vLLM, nothing is matched in the first `min_tokens` tokens, and
`spaces_between_special_tokens` changes nothing (vLLM's fast detokenizer ignores it too).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito.contract import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tito.errors import FailedPrecondition, InvalidArgument
from tito.stop_strings import StopMatch, StopStringMatcher

STOP_STRINGS_TOO_LARGE = "STOP_STRINGS_TOO_LARGE"
#: Prompt tokens the decoder is seeded with: the first output token's text depends on a few.
PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class StopStringOptions:
    """A request's stop strings and how its text is decoded to match them."""

    stops: tuple[str, ...]
    include_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


def check_stop_strings(stops: tuple[str, ...], field: str) -> None:
    """The contract's bound (tito.contract: at most MAX_STOP_STRINGS of MAX_STOP_STRING_CHARS
    characters): every stop string is matched against each token's text, so an unbounded list
    would cost unbounded time per token."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stops)} stop strings: at most {MAX_STOP_STRINGS}", reason=STOP_STRINGS_TOO_LARGE,
                              field=field, metadata={"limit": "max_stop_strings", "max": str(MAX_STOP_STRINGS)})
    for position, stop in enumerate(stops):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stop string of {len(stop)} characters: at most {MAX_STOP_STRING_CHARS}",
                                  reason=STOP_STRINGS_TOO_LARGE, field=f"{field}[{position}]",
                                  metadata={"limit": "max_stop_string_chars", "max": str(MAX_STOP_STRING_CHARS)})


class TokenizerSource:
    """The model's tokenizer (tokenizer.json), read on the first request that needs it: an engine
    whose callers never send stop strings never pays for it."""

    def __init__(self, model_dir: Path, vocab_size: int):
        self._path = Path(model_dir) / "tokenizer.json"
        self._vocab_size = vocab_size  # ids past the tokenizer's entries (padding) have no text
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_file(str(self._path))
                except Exception as exc:  # noqa: BLE001 - missing file or one tokenizers cannot read
                    raise FailedPrecondition(
                        f"stop strings need the model's tokenizer.json, which could not be read ({exc}); "
                        f"send stop_token_ids instead", reason="TOKENIZER_UNAVAILABLE",
                        field="sampling_params.stop") from None
            return self._tokenizer

    def has_text(self, token_id: int) -> bool:
        return token_id < self._vocab_size


@dataclass(frozen=True)
class StopHit:
    """A stop string completed: keep the first `kept` ids of the output that completed it."""

    kept: int
    stop: str
    completion_tokens: int  # the choice's tokens in all, up to and including the stop


class ChoiceStops:
    """One choice's decoder and matcher."""

    def __init__(self, source: TokenizerSource, options: StopStringOptions, prompt_tail: list[int]):
        from tokenizers.decoders import DecodeStream

        self._source = source
        self._tokenizer = source.get()
        self._options = options
        tail = [token_id for token_id in prompt_tail if source.has_text(token_id)]
        self._decoder = DecodeStream(tail, skip_special_tokens=options.skip_special_tokens)
        self._matcher = StopStringMatcher(options.stops, options.include_in_output)
        self._count = 0

    def feed(self, token_ids: tuple[int, ...]) -> StopHit | None:
        for position, token_id in enumerate(token_ids):
            self._count += 1
            if not self._source.has_text(token_id):
                continue
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece is None or self._count <= self._options.min_tokens:
                continue
            matched = self._matcher.feed(piece)
            if isinstance(matched, StopMatch):
                return StopHit(position + 1, matched.stop, self._count)
        return None


class RequestStops:
    """The stop-string state of one request's choices."""

    def __init__(self, source: TokenizerSource, options: StopStringOptions, prompt_ids: list[int]):
        self._source = source
        self._options = options
        self._tail = list(prompt_ids[-PROMPT_TAIL_TOKENS:])
        self._choices: dict[int, ChoiceStops] = {}
        self.ended_a_choice = False  # a stop string ended a choice the backend is still generating

    def feed(self, index: int, token_ids: tuple[int, ...]) -> StopHit | None:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = ChoiceStops(self._source, self._options, self._tail)
        hit = choice.feed(token_ids)
        self.ended_a_choice = self.ended_a_choice or hit is not None
        return hit
