"""Fixtures shared by the integration tests (the servers themselves come from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_text_model):
    """transformers' own tokenizer of the tiny text model: the reference the servers' token ids
    and texts are checked against."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    """An HMAC key file the engines of a prefill/decode pair share (--hmac-key-file)."""
    path = tmp_path_factory.mktemp("pd-key") / "hmac.key"
    path.write_bytes(b"k" * 32)
    return path
