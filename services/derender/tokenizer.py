"""The tokenizer facts derender needs, behind one small class.

Derender loads only the tokenizer of `--model`. Decoding goes through the `tokenizers` backend
directly (no Python-level token loop), always with special tokens kept: which special tokens
to drop is decided by the detokenizer, which filters them out before they reach the decoder
(exactly what `skip_special_tokens=True` does inside `tokenizers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class TextTokenizer:
    """Vocabulary size, special ids and windowed decoding of one Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        #: Valid token ids are [0, vocab_size): the base vocabulary plus added tokens.
        self.vocab_size = len(hf_tokenizer)
        special = set(getattr(hf_tokenizer, "all_special_ids", ()) or ())
        for token_id, added in (getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special.add(int(token_id))
        self.special_ids: frozenset[int] = frozenset(special)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = lambda ids: backend.decode(list(ids), skip_special_tokens=False)
        else:  # a slow (pure Python) tokenizer: same contract, slower
            self._decode = lambda ids: hf_tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @classmethod
    def load(cls, model_dir: Path | str) -> "TextTokenizer":
        from transformers import AutoTokenizer  # heavy import, only when a model is loaded

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens included. Callers pass short windows."""
        return self._decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own, e.g. "<|im_end|>" for a stop token."""
        return self._decode([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids
