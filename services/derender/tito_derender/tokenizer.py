"""The tokenizer facts derender needs, behind one small class.

Derender loads only the tokenizer of `--model`, and loads it with the `tokenizers` library
directly from `tokenizer.json` (its special tokens from `tokenizer.json` and
`tokenizer_config.json`): no transformers, so no torch either, even where they are installed.
Only a model directory without `tokenizer.json` (a slow SentencePiece or vocab.json tokenizer)
goes through transformers' AutoTokenizer. Decoding goes through the `tokenizers` backend (no
Python-level token loop), always with special tokens kept: which special tokens to drop is
decided by the detokenizer, which filters them out before they reach the decoder (exactly what
`skip_special_tokens=True` does inside `tokenizers`).

Valid ids follow tito.vocab: [0, vocab_size) with vocab_size the model's embedding rows (from the
model directory's config.json), which may be more than the tokenizer's entries. Ids the
tokenizer does not name (padding ids) decode as empty text, as Hugging Face's decode does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tito.config import ConfigError
from tito.vocab import Vocabulary, build_vocabulary, config_vocab_size, read_model_config

#: Files one of which a model directory needs for its tokenizer to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: tokenizer_config.json keys naming special tokens (transformers' special-token attributes).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_contents(value: Any) -> Iterable[str]:
    """The token texts of a tokenizer_config.json special-token value (a string, an AddedToken
    dict, or a list or dict of them)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict) and isinstance(value.get("content"), str):
        yield value["content"]
    elif isinstance(value, dict):
        for item in value.values():
            yield from _token_contents(item)
    elif isinstance(value, list):
        for item in value:
            yield from _token_contents(item)


def _special_and_added_ids(model_dir: Path, backend: Any) -> tuple[frozenset[int], frozenset[int]]:
    """(special ids, added ids) as transformers computes them: the special-token attributes of
    tokenizer_config.json and every added token marked special, in either file."""
    config = _read_json(model_dir / "tokenizer_config.json")
    special: set[int] = set()
    added: set[int] = set()
    for key in (*_SPECIAL_TOKEN_KEYS, *_SPECIAL_TOKEN_LISTS):
        for content in _token_contents(config.get(key)):
            token_id = backend.token_to_id(content)
            if token_id is not None:
                special.add(token_id)
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        added.add(int(token_id))
        if isinstance(token, dict) and token.get("special"):
            special.add(int(token_id))
    for token in _read_json(model_dir / "tokenizer.json").get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            added.add(token["id"])
            if token.get("special"):
                special.add(token["id"])
    return frozenset(special), frozenset(added)


class TextTokenizer:
    """Vocabulary size, special ids and windowed decoding of one model's tokenizer."""

    def __init__(self, model_dir: Path, backend: Any, vocabulary: Vocabulary, special_ids: Iterable[int],
                 added_ids: Iterable[int], slow_decode: Any = None, id_to_token: Any = None) -> None:
        """`backend`: a `tokenizers.Tokenizer` (None for a pure-Python tokenizer, which then
        gives `slow_decode(ids)` and `id_to_token(id)`)."""
        self.model_dir = model_dir
        self.backend = backend
        self.vocabulary = vocabulary
        #: Valid token ids are [0, vocab_size): the model's embedding rows (tito.vocab).
        self.vocab_size = vocabulary.vocab_size
        #: Valid ids no tokenizer entry names: they decode as "".
        self.padding_ids: frozenset[int] = frozenset(vocabulary.padding_ids)
        self.special_ids: frozenset[int] = frozenset(special_ids)
        #: Added tokens (special or not) are stored as their text, not as byte-level pieces.
        self._added_ids = frozenset(added_ids)
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
            self._id_to_token = backend.id_to_token
        else:  # a slow (pure Python) tokenizer: same contract, slower
            self._decode = slow_decode
            self._id_to_token = id_to_token

    @classmethod
    def load(cls, model_dir: Path | str) -> "TextTokenizer":
        model_dir = Path(model_dir)
        if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
            # Without these transformers builds an empty tokenizer that decodes nothing.
            raise ConfigError(f"--model {model_dir}: no tokenizer in it (expected one of {', '.join(TOKENIZER_FILES)})")
        model_config = read_model_config(model_dir)
        if (model_dir / "tokenizer.json").is_file():
            return cls._from_tokenizer_json(model_dir, model_config)
        return cls._from_transformers(model_dir, model_config)

    @classmethod
    def _from_tokenizer_json(cls, model_dir: Path, model_config: dict[str, Any]) -> "TextTokenizer":
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
            raise ConfigError(f"--model {model_dir}: tokenizer.json does not load ({exc})") from None
        special, added = _special_and_added_ids(model_dir, backend)
        vocabulary = build_vocabulary(config_vocab_size(model_config), backend.get_vocab_size(with_added_tokens=True),
                                      backend.get_vocab(with_added_tokens=True).values())
        return cls(model_dir, backend, vocabulary, special, added)

    @classmethod
    def _from_transformers(cls, model_dir: Path, model_config: dict[str, Any]) -> "TextTokenizer":
        """A tokenizer without tokenizer.json (SentencePiece or vocab.json files): transformers
        loads it, converted to a fast one where it can be."""
        from transformers import AutoTokenizer  # heavy import, only for tokenizers without tokenizer.json

        hf = AutoTokenizer.from_pretrained(str(model_dir))
        special = set(getattr(hf, "all_special_ids", ()) or ())
        decoder = getattr(hf, "added_tokens_decoder", {}) or {}
        special.update(int(i) for i, token in decoder.items() if getattr(token, "special", False))
        vocabulary = build_vocabulary(config_vocab_size(model_config), len(hf), hf.get_vocab().values())
        backend = getattr(hf, "backend_tokenizer", None)
        return cls(model_dir, backend, vocabulary, special, (int(i) for i in decoder),
                   slow_decode=lambda ids: hf.decode(list(ids), skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False),
                   id_to_token=hf.convert_ids_to_tokens)

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
            piece = self._id_to_token(token_id)
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
