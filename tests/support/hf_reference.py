"""transformers' own tokenizer for a derender TextTokenizer's model directory: the reference the
derender tests compare with (derender itself loads tokenizer.json without transformers)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def _hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_of(tokenizer) -> object:
    """The Hugging Face tokenizer of `tokenizer.model_dir` (loaded once per directory)."""
    return _hf_tokenizer(str(Path(tokenizer.model_dir)))
