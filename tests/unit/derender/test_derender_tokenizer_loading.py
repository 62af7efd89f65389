"""Derender reads tokenizer.json with the `tokenizers` library alone; what it learns must be what
transformers' AutoTokenizer reports for the same directory: special ids, vocabulary sizes,
padding ids, and every token's text and bytes."""

from __future__ import annotations

import pytest

from family_tokenizers import FAMILIES, ensure_family_tokenizer
from tito.vocab import read_model_config
from tito_derender.tokenizer import TextTokenizer


def _through_transformers(model_dir) -> TextTokenizer:
    """The same directory loaded the other way: transformers' AutoTokenizer."""
    return TextTokenizer._from_transformers(model_dir, read_model_config(model_dir))


def _assert_same(fast: TextTokenizer, slow: TextTokenizer) -> None:
    assert fast.special_ids == slow.special_ids
    assert fast.vocabulary.tokenizer_vocab_size == slow.vocabulary.tokenizer_vocab_size
    assert fast.padding_ids == slow.padding_ids
    assert fast.byte_fallback_ids == slow.byte_fallback_ids
    for token_id in range(fast.vocab_size):
        assert fast.token_text(token_id) == slow.token_text(token_id), token_id
        assert fast.token_bytes(token_id) == slow.token_bytes(token_id), token_id


@pytest.mark.parametrize("fixture", ["tiny_text_model", "tiny_vl_model", "tiny_interleaved_vl_model",
                                     "tiny_llama_model", "tiny_padded_model", "tiny_qwen3_model"])
def test_tiny_models_load_as_transformers_loads_them(request, fixture):
    directory = request.getfixturevalue(fixture)
    _assert_same(TextTokenizer.load(directory), _through_transformers(directory))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_tokenizers_load_as_transformers_loads_them(family, model_cache):
    directory = ensure_family_tokenizer(family, model_cache)
    _assert_same(TextTokenizer.load(directory), _through_transformers(directory))


def test_sentencepiece_style_tokenizer_loads_as_transformers_loads_it(tmp_path):
    from metaspace_tokenizer import build_metaspace_tokenizer

    directory = build_metaspace_tokenizer(tmp_path)
    _assert_same(TextTokenizer.load(directory), _through_transformers(directory))


def test_a_broken_tokenizer_json_is_one_clear_error(tmp_path):
    from tito.config import ConfigError

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json does not load"):
        TextTokenizer.load(tmp_path)
