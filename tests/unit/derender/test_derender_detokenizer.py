"""Incremental detokenization against the tokenizer's own full decode."""

from __future__ import annotations

import random

import pytest

from tito_derender.detokenizer import IncrementalDetokenizer, TextOptions, detokenize
from tito_derender.tokenizer import TextTokenizer
from hf_reference import hf_of

TEXTS = ["Hello world", "日本語のテキスト", "café au lait", "emoji 🎉🚀 done", "a<|im_end|>b", "<think>hmm</think> ok",
         " leading spaces  and\ttabs\n", "mixed 日本 café 🎉 end"]


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model) -> TextTokenizer:
    return TextTokenizer.load(tiny_text_model)


def chunkings(ids: list[int], rng: random.Random):
    yield [[i] for i in ids]
    yield [ids]
    out, pos = [], 0
    while pos < len(ids):
        size = rng.randint(0, 5)  # 0: an empty message, as a final engine message may be
        out.append(ids[pos:pos + size])
        pos += size
    yield out


def stream_text(tokenizer, chunks, options, tail=()) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, options, tail)
    return "".join(detokenizer.add(chunk) for chunk in chunks) + detokenizer.flush()


def random_sequences(tokenizer: TextTokenizer, rng: random.Random, count: int):
    special = sorted(tokenizer.special_ids)
    for _ in range(count):
        kind = rng.random()
        if kind < 0.4:  # encoded text, multi-byte characters and special tokens included
            text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 4)))
            ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
        elif kind < 0.8:  # raw random ids: byte tokens that do not form valid UTF-8, any order
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        else:  # runs of adjacent special tokens between text
            ids = []
            for _ in range(rng.randint(1, 5)):
                ids += [rng.choice(special) for _ in range(rng.randint(1, 3))]
                ids += hf_of(tokenizer).encode(rng.choice(TEXTS), add_special_tokens=False)
        yield ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)
    options = TextOptions(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    for ids in random_sequences(tokenizer, rng, 150):
        expected = hf_of(tokenizer).decode(ids, skip_special_tokens=skip_special_tokens)
        for chunks in chunkings(ids, rng):
            assert stream_text(tokenizer, chunks, options) == expected, (ids, chunks)


def test_never_emits_half_a_character(tokenizer):
    ids = hf_of(tokenizer).encode("日本 café 🎉", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, TextOptions())
    pieces = [detokenizer.add([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == "日本 café 🎉"
    assert all("\ufffd" not in piece for piece in pieces)
    # Some token of this text is a partial character, so at least one step must have held back.
    assert "" in pieces[:-1]


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(tokenizer):
    ids = hf_of(tokenizer).encode("ok 🎉", add_special_tokens=False)[:-1]  # cut inside the emoji
    expected = hf_of(tokenizer).decode(ids)
    assert expected.endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer, TextOptions())
    streamed = "".join(detokenizer.add([i]) for i in ids)
    assert not streamed.endswith("\ufffd")
    assert streamed + detokenizer.flush() == expected


def test_spaces_between_adjacent_kept_special_tokens(tokenizer):
    im_end, im_start = hf_of(tokenizer).convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    ids = hf_of(tokenizer).encode("Hi", add_special_tokens=False) + [im_end, im_start] + \
        hf_of(tokenizer).encode("there", add_special_tokens=False) + [im_end]
    spaced = TextOptions(skip_special_tokens=False, spaces_between_special_tokens=True)
    tight = TextOptions(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert detokenize(tokenizer, ids, spaced) == "Hi<|im_end|> <|im_start|>there<|im_end|>"
    assert detokenize(tokenizer, ids, tight) == "Hi<|im_end|><|im_start|>there<|im_end|>"
    # Same in a stream, one id at a time.
    assert stream_text(tokenizer, [[i] for i in ids], spaced) == "Hi<|im_end|> <|im_start|>there<|im_end|>"
    # Skipped special tokens leave no spaces behind.
    assert detokenize(tokenizer, ids, TextOptions()) == "Hithere"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_prompt_tail_seeding_matches_decoding_prompt_and_output_together(tokenizer, skip_special_tokens):
    options = TextOptions(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    cases = [("<|im_start|>assistant\nSure,", " here it is"), ("Hello", " world"), ("x", "日本"),
             ("say café", " 🎉 ok"), ("line\n", "next line")]
    for prompt, output in cases:
        prompt_ids = hf_of(tokenizer).encode(prompt, add_special_tokens=False)
        output_ids = hf_of(tokenizer).encode(prompt + output, add_special_tokens=False)[len(prompt_ids):]
        assert output_ids, (prompt, output)
        full = hf_of(tokenizer).decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
        prompt_text = hf_of(tokenizer).decode(prompt_ids, skip_special_tokens=skip_special_tokens)
        tail = prompt_ids[-4:]
        streamed = stream_text(tokenizer, [[i] for i in output_ids], options, tail)
        assert streamed == full[len(prompt_text):]
        assert streamed.startswith(output[0])  # the leading space (or first character) is kept


def test_tail_with_a_special_token_is_filtered_when_skipping(tokenizer):
    im_start = hf_of(tokenizer).convert_tokens_to_ids("<|im_start|>")
    output = hf_of(tokenizer).encode(" fine", add_special_tokens=False)
    assert stream_text(tokenizer, [output], TextOptions(), [im_start]) == " fine"


class CountingTokenizer(TextTokenizer):
    """Records the size of every decode window."""

    def __init__(self, inner: TextTokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.windows: list[int] = []
        inner_decode = inner.decode
        self.decode = lambda ids: (self.windows.append(len(ids)), inner_decode(ids))[1]


def test_cost_per_token_does_not_grow_with_output_length(tokenizer):
    counting = CountingTokenizer(tokenizer)
    rng = random.Random(7)
    text = "".join(rng.choice(TEXTS) for _ in range(300))
    ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    detokenizer = IncrementalDetokenizer(counting, TextOptions(), ids[:3])
    streamed = "".join(detokenizer.add([i]) for i in ids) + detokenizer.flush()
    assert streamed == hf_of(tokenizer).decode(ids, skip_special_tokens=True)
    # At most two small decodes per token; never the whole output.
    assert len(counting.windows) <= 2 * len(ids) + 2
    assert max(counting.windows) <= 12
    assert detokenizer.window_size <= 12


def test_a_long_run_of_skipped_special_tokens_costs_nothing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    eos = hf_of(tokenizer).convert_tokens_to_ids("<|endoftext|>")
    detokenizer = IncrementalDetokenizer(counting, TextOptions())
    assert detokenizer.add([eos] * 5000) == ""
    assert counting.windows == []
