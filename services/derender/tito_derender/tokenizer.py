"""The tokenizer facts derender needs, behind one small class.

Derender loads only the tokenizer of `--model`. Decoding goes through the `tokenizers` backend
directly (no Python-level token loop), always with special tokens kept: which special tokens
to drop is decided by the detokenizer, which filters them out before they reach the decoder
(exactly what `skip_special_tokens=True` does inside `tokenizers`).

Valid ids follow tito.vocab: [0, vocab_size) with vocab_size the model's embedding rows (from the
model directory's config.json), which may be more than the tokenizer's entries. Ids the
tokenizer does not name (padding ids) decode as empty text, as Hugging Face's decode does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tito.vocab import Vocabulary, read_model_config, vocabulary_of

from tito.config import ConfigError

#: Files one of which a model directory needs for its tokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table (byte-level BPE token strings -> bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


class TextTokenizer:
    """Vocabulary size, special ids and windowed decoding of one Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer, model_config: dict[str, Any] | None = None) -> None:
        self.hf = hf_tokenizer
        self.vocabulary: Vocabulary = vocabulary_of(hf_tokenizer, model_config or {})
        #: Valid token ids are [0, vocab_size): the model's embedding rows (tito.vocab).
        self.vocab_size = self.vocabulary.vocab_size
        #: Valid ids no tokenizer entry names: they decode as "".
        self.padding_ids: frozenset[int] = frozenset(self.vocabulary.padding_ids)
        special = set(getattr(hf_tokenizer, "all_special_ids", ()) or ())
        for token_id, added in (getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special.add(int(token_id))
        self.special_ids: frozenset[int] = frozenset(special)
        #: Added tokens (special or not) are stored as their text, not as byte-level pieces.
        self._added_ids = frozenset(int(i) for i in (getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}))
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        #: SentencePiece byte-fallback tokens ("<0xE6>"), when the decoder turns them into bytes.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if backend is not None and "ByteFallback" in repr(backend.decoder):
            self.byte_fallback_ids = frozenset(
                token_id for token, token_id in backend.get_vocab(with_added_tokens=False).items()
                if _BYTE_FALLBACK.fullmatch(token))
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        if backend is not None:
            self._decode = lambda ids: backend.decode(list(ids), skip_special_tokens=False)
        else:  # a slow (pure Python) tokenizer: same contract, slower
            self._decode = lambda ids: hf_tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @classmethod
    def load(cls, model_dir: Path | str) -> "TextTokenizer":
        from transformers import AutoTokenizer  # heavy import, only when a model is loaded

        if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
            # Without these transformers builds an empty tokenizer that decodes nothing.
            raise ConfigError(f"--model {model_dir}: no tokenizer in it (expected one of {', '.join(TOKENIZER_FILES)})")
        return cls(AutoTokenizer.from_pretrained(str(model_dir)), read_model_config(Path(model_dir)))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens included. Callers pass short windows."""
        return self._decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own, e.g. "<|im_end|>" for a stop token (cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = "" if token_id in self.padding_ids else self._decode([token_id])
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: for byte-level BPE and SentencePiece byte-fallback tokens
        these may be part of a UTF-8 character (where token_text shows U+FFFD). Cached."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return raw

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self.padding_ids:
            return b""
        if token_id not in self._added_ids and not self.is_special(token_id):
            piece = self.hf.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                table = _unicode_to_byte()
                if self._byte_level and all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
                fallback = _BYTE_FALLBACK.fullmatch(piece)
                if fallback:
                    return bytes([int(fallback.group(1), 16)])
                if "▁" in piece:  # SentencePiece: the word-boundary mark is a space
                    return piece.replace("▁", " ").encode("utf-8")
        return self.token_text(token_id).encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def is_padding(self, token_id: int) -> bool:
        """A valid id the tokenizer does not name (see tito.vocab): its text is empty."""
        return token_id in self.padding_ids
