"""Incremental detokenization: token ids in, text deltas out, O(1) work per token.

The algorithm is the one `tokenizers.decoders.DecodeStream` (and vLLM's prefix/read offsets)
use, written out here because derender needs two things DecodeStream does not offer: a flush of
held-back bytes when a choice ends, and a window it can bound and test.

State is a short window of ids and `prefix`, the text of the window's first `read_index` ids.
Each new id is appended and the window decoded; the text beyond `prefix` is new, unless it ends
in U+FFFD (an incomplete UTF-8 sequence, e.g. the first byte token of "日"), in which case it
is held back until a later token completes the character. After each emission the window drops
everything before the last emission's tokens, so a decode call sees a few ids however long the
output is. Decoding a few previous ids along with the new one is what gets merges and leading
spaces right (e.g. SentencePiece's "▁" handling), and why the window is seeded with the prompt's
last tokens.

SentencePiece byte fallback: characters spelled as byte tokens ("<0xE6><0x97><0xA5>") are sent as
soon as they are complete. One difference from a whole decode remains, by design: the
ByteFallback decoder turns an entire run of byte tokens into U+FFFD when any byte of the run is
invalid, which no stream can do without holding back every run in full (a paragraph of CJK is
one run); a stream keeps the valid characters it already sent.

Padding ids (valid ids the tokenizer does not name, tito.vocab) have no text and never enter
the window, exactly as Hugging Face's decode ignores them.

Special tokens: with skip_special_tokens they never enter the window (that is exactly what
decode(skip_special_tokens=True) does), so a run of them costs nothing. When they are kept, the
text is the tokenizer's own decode by default; with spaces_between_special_tokens explicitly on,
adjacent kept special tokens are separated by one space, as the OutputTextOptions contract says.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tito_derender.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"
#: Prompt-tail ids the window is seeded with, at most (the last ones). Render sends 8; a few are
#: all the first token's text depends on, and every decode before the first emission sees the
#: whole seed, so a caller's huge tail must not make each step cost O(tail).
MAX_SEED_TOKENS = 32


@dataclass(frozen=True)
class TextOptions:
    """The detokenization part of OutputTextOptions, with the contract's defaults applied."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False


class IncrementalDetokenizer:
    """Per-choice detokenizer state. `add(ids)` returns the text that became final."""

    def __init__(self, tokenizer: TextTokenizer, options: TextOptions = TextOptions(),
                 prompt_tail_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._options = options
        self._window: list[int] = [t for t in prompt_tail_token_ids if self._enters_window(t)][-MAX_SEED_TOKENS:]
        self._prefix = tokenizer.decode(self._window) if self._window else ""
        self._read_index = len(self._window)
        self._previous_output_special = False

    def _enters_window(self, token_id: int) -> bool:
        if self._tokenizer.is_padding(token_id):
            return False  # no text, like HF's decode: it must not hold back or split anything
        return not (self._options.skip_special_tokens and self._tokenizer.is_special(token_id))

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed new ids; return the text now final (may be "" while a character is incomplete)."""
        return "".join(self._step(token_id) for token_id in token_ids)

    def _step(self, token_id: int) -> str:
        if self._tokenizer.is_padding(token_id):
            return ""
        special = self._tokenizer.is_special(token_id)
        if special and self._options.skip_special_tokens:
            return ""
        separator = ""
        if special and self._previous_output_special and self._options.spaces_between_special_tokens:
            separator = " "
        self._previous_output_special = special
        self._window.append(token_id)
        text = self._tokenizer.decode(self._window)
        if len(text) <= len(self._prefix) or text.endswith(_REPLACEMENT):
            return separator  # nothing final yet: hold the bytes back
        new_text = text[len(self._prefix):]
        # Keep only the ids of this emission: the next decode needs them as left context.
        self._window = self._window[self._read_index:]
        self._read_index = len(self._window)
        self._prefix = self._tokenizer.decode(self._window)
        return separator + new_text

    def flush(self) -> str:
        """At the end of a choice: the held-back text, U+FFFD included, as a full decode gives it."""
        if len(self._window) <= self._read_index:
            return ""
        text = self._tokenizer.decode(self._window)
        new_text = text[len(self._prefix):]
        self._window = self._window[self._read_index:]
        self._read_index = len(self._window)
        self._prefix = self._tokenizer.decode(self._window)
        return new_text

    @property
    def window_size(self) -> int:
        """Ids the next decode will see besides the new one (bounded; for tests and debugging)."""
        return len(self._window)


def detokenize(tokenizer: TextTokenizer, token_ids: Sequence[int], options: TextOptions = TextOptions()) -> str:
    """Whole-sequence text with exactly the streaming rules (so Detokenize and streams agree)."""
    detokenizer = IncrementalDetokenizer(tokenizer, options)
    return detokenizer.add(token_ids) + detokenizer.flush()
