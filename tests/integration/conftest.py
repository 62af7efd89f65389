"""Fixtures shared by the integration tests (the servers themselves come from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_text_model):
    """transformers' own tokenizer of the tiny text model: the reference the servers' token ids
    and texts are checked against."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_text_model))
