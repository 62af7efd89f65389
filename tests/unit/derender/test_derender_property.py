"""Property: whatever the token ids and however the engine splits them into messages, the
content a derender stream sends concatenates to tokenizer.decode(ids, skip_special_tokens=...).

Tokenizers: the tiny model's byte-level BPE, two SentencePiece-style ones (Metaspace and Llama
decoders, byte fallback) and, when it can be built offline, Qwen's real vocabulary.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tito_derender.detokenizer import TextOptions
from tito_derender.domain import EngineOutput, FinishReason, RequestContext
from tito_derender.stream import DerenderStream
from hf_reference import hf_of

TEXTS = ["Hello world", "日本語のテキスト", "café au lait", "emoji 🎉🚀 done", " leading  spaces\tand\n",
         "mixed 日本 café 🎉 end", "<think>hmm</think> ok", "a<|im_end|>b", "über naïve façade", "12345 !?"]

TOKENIZERS = ["tiny_tokenizer", "metaspace_tokenizer", "llama_sp_tokenizer", "real_vocab_tokenizer"]


@st.composite
def token_sequences(draw, tokenizer):
    """Raw random ids (any byte soup, special tokens included) or the ids of real text."""
    if draw(st.booleans()):
        special = sorted(tokenizer.special_ids)
        base = st.integers(0, tokenizer.vocab_size - 1)
        if tokenizer.byte_fallback_ids:
            # Byte-fallback runs must be valid UTF-8 (see the detokenizer's docstring): random
            # other ids, plus characters spelled in byte tokens.
            base = base.filter(lambda i: i not in tokenizer.byte_fallback_ids)
            spelled = st.characters(codec="utf-8", min_codepoint=0x80).map(
                lambda ch: [hf_of(tokenizer).convert_tokens_to_ids(f"<0x{b:02X}>") for b in ch.encode("utf-8")])
            base = st.one_of(base.map(lambda i: [i]), spelled)
        else:
            base = base.map(lambda i: [i])
        pool = st.one_of(base, st.sampled_from(special).map(lambda i: [i])) if special else base
        return [i for group in draw(st.lists(pool, min_size=0, max_size=30)) for i in group]
    text = "".join(draw(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=4)))
    return hf_of(tokenizer).encode(text, add_special_tokens=False)


@st.composite
def chunkings(draw, ids):
    """One id per message, all at once, or random sizes (empty messages included)."""
    kind = draw(st.sampled_from(["one", "all", "random"]))
    if kind == "one":
        return [[i] for i in ids]
    if kind == "all":
        return [list(ids)]
    pieces, position = [], 0
    while position < len(ids):
        size = draw(st.integers(0, 6))
        pieces.append(list(ids[position:position + size]))
        position += size
    return pieces


def streamed_content(tokenizer, pieces, skip_special_tokens):
    context = RequestContext(text=TextOptions(skip_special_tokens=skip_special_tokens))
    stream = DerenderStream(tokenizer, context)
    chunks = []
    for piece in pieces:
        chunks += stream.feed(EngineOutput(index=0, token_ids=tuple(piece)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.LENGTH))
    assert stream.finished
    return chunks


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_streamed_content_equals_decode(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def check(data):
        ids = data.draw(token_sequences(tokenizer), label="ids")
        pieces = data.draw(chunkings(ids), label="pieces")
        skip = data.draw(st.booleans(), label="skip_special_tokens")
        chunks = streamed_content(tokenizer, pieces, skip)
        expected = hf_of(tokenizer).decode(ids, skip_special_tokens=skip)
        assert "".join(c.content for c in chunks) == expected
        # Half characters are never sent mid-stream: a U+FFFD appears only where decode has one.
        if "\ufffd" not in expected:
            assert all("\ufffd" not in c.content for c in chunks)

    check()


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_prompt_tail_gives_the_first_token_its_leading_space(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for prompt, output in [("Hello", " world"), ("say café", " 🎉 ok"), ("The quick", " brown fox"),
                           ("x", " 日本")]:
        prompt_ids = hf_of(tokenizer).encode(prompt, add_special_tokens=False)
        all_ids = hf_of(tokenizer).encode(prompt + output, add_special_tokens=False)
        assert all_ids[:len(prompt_ids)] == prompt_ids, (prompt, output)
        output_ids = all_ids[len(prompt_ids):]
        stream = DerenderStream(tokenizer, RequestContext(prompt_tail_token_ids=tuple(prompt_ids[-4:])))
        chunks = []
        for token_id in output_ids:
            chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
        chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
        full = hf_of(tokenizer).decode(all_ids)
        assert "".join(c.content for c in chunks) == full[len(hf_of(tokenizer).decode(prompt_ids)):]
        assert chunks[0].content.startswith(" "), (tokenizer_name, prompt, chunks[0])
