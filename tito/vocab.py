"""What a valid token id is: one definition for render, engine and derender.

A model has two vocabulary sizes. Its embedding matrix has `vocab_size` rows (config.json
`vocab_size`, or `text_config.vocab_size`), often padded past the tokenizer to a multiple of 64
or 128 for faster kernels: Qwen2/2.5/3 have 151,936 rows for 151,669 tokenizer entries. Its
tokenizer has `tokenizer_vocab_size` entries (`len(tokenizer)`: base vocabulary plus added
tokens).

- A token id is valid when 0 <= id < vocab_size (the embedding rows): the engine can embed it
  and may generate it, so every service accepts it.
- Valid ids that no tokenizer entry names are *padding ids*. They decode as empty text, exactly
  as Hugging Face's `decode` does, and never end a stream. The native engine masks them out of
  sampling by default (`--exclude-padding-ids`).
- When config.json has no vocab_size (a tokenizer-only directory), the embedding rows are taken
  to be the tokenizer's size; when it has fewer rows than the tokenizer has entries, the ids past
  the rows are not valid (the engine could not embed them).

Both GetModelInfo responses report both sizes from this module, so render and engine agree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vocabulary:
    """The two sizes of a model's vocabulary and the padding ids between them."""

    #: Embedding rows: valid token ids are [0, vocab_size).
    vocab_size: int
    #: Tokenizer entries (base vocabulary plus added tokens).
    tokenizer_vocab_size: int
    #: Valid ids no tokenizer entry names (sorted): they decode as empty text.
    padding_ids: tuple[int, ...] = ()

    def is_valid(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    def describe(self) -> str:
        """For start-up logs, e.g. "151936 ids (151669 tokenizer entries, 267 padding ids)"."""
        if not self.padding_ids:
            return f"{self.vocab_size} ids"
        return (f"{self.vocab_size} ids ({self.tokenizer_vocab_size} tokenizer entries, "
                f"{len(self.padding_ids)} padding ids)")


def config_vocab_size(model_config: dict[str, Any]) -> int | None:
    """Embedding rows as config.json declares them (top level, else text_config); None if absent."""
    for section in (model_config, model_config.get("text_config") or {}):
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict ({} when absent or unreadable: a tokenizer-only directory)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def build_vocabulary(embedding_rows: int | None, tokenizer_size: int, known_ids: Iterable[int]) -> Vocabulary:
    """The vocabulary of a model whose embedding has `embedding_rows` rows (None: unknown, take the
    tokenizer's size) and whose tokenizer has `tokenizer_size` entries with ids `known_ids`."""
    vocab_size = embedding_rows or tokenizer_size
    known = {token_id for token_id in known_ids if 0 <= token_id < vocab_size}
    padding = tuple(token_id for token_id in range(vocab_size) if token_id not in known) \
        if len(known) < vocab_size else ()
    return Vocabulary(vocab_size=vocab_size, tokenizer_vocab_size=tokenizer_size, padding_ids=padding)


def vocabulary_of(hf_tokenizer: Any, model_config: dict[str, Any]) -> Vocabulary:
    """The vocabulary of a loaded Hugging Face tokenizer and its model's config.json."""
    return build_vocabulary(config_vocab_size(model_config), len(hf_tokenizer), hf_tokenizer.get_vocab().values())


def load_vocabulary(model_dir: Path, embedding_rows: int | None = None) -> Vocabulary:
    """For a service that loads no tokenizer of its own (the engine): read the tokenizer only to
    learn its ids. `embedding_rows` (the loaded weights' count) wins over config.json. Without a
    loadable tokenizer every row counts as a token (no padding ids), with a warning."""
    rows = embedding_rows or config_vocab_size(read_model_config(model_dir))
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        if rows is None:
            raise
        log.warning("no tokenizer in %s (%s): every one of the %d embedding rows counts as a token", model_dir,
                    exc, rows)
        return Vocabulary(vocab_size=rows, tokenizer_vocab_size=rows)
    return build_vocabulary(rows, len(tokenizer), tokenizer.get_vocab().values())
