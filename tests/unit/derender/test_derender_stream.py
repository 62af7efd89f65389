"""The per-request state machine: chunks, finish, usage, multiplexed choices, validation."""

from __future__ import annotations

import random

import pytest

from tito.errors import FailedPrecondition, InvalidArgument
from tito_derender.detokenizer import TextOptions
from tito_derender.domain import EngineOutput, EngineUsage, FinishReason, RequestContext
from tito_derender.full import derender_full
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer
from hf_reference import hf_of


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model) -> TextTokenizer:
    return TextTokenizer.load(tiny_text_model)


def encode(tokenizer, text):
    return hf_of(tokenizer).encode(text, add_special_tokens=False)


def test_chunks_role_first_no_empty_chunks_and_final_with_usage(tokenizer):
    ids = encode(tokenizer, "🎉 is nice")
    im_end = hf_of(tokenizer).convert_tokens_to_ids("<|im_end|>")
    stream = DerenderStream(tokenizer, RequestContext(prompt_tokens=11))
    chunks = []
    for token_id in ids:
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    # The first byte tokens of 🎉 yield nothing: no chunk for it.
    assert len(chunks) < len(ids)
    assert all(c.content for c in chunks)
    assert [c.role for c in chunks] == ["assistant"] + [""] * (len(chunks) - 1)
    final = stream.feed(EngineOutput(index=0, token_ids=(im_end,), finish_reason=FinishReason.STOP,
                                     matched_stop_token_id=im_end))
    assert len(final) == 1
    last = final[0]
    assert last.content == "" and last.finish_reason is FinishReason.STOP
    assert last.matched_stop == "<|im_end|>"
    assert last.usage.prompt_tokens == 11 and last.usage.completion_tokens == len(ids) + 1
    assert "".join(c.content for c in chunks) == "🎉 is nice"
    assert stream.finished


def test_final_message_alone_still_gets_role_and_engine_usage_wins(tokenizer):
    stream = DerenderStream(tokenizer, RequestContext(prompt_tokens=3))
    [chunk] = stream.feed(EngineOutput(index=0, finish_reason=FinishReason.LENGTH,
                                       usage=EngineUsage(prompt_tokens=9, completion_tokens=0, cached_tokens=4)))
    assert chunk.role == "assistant" and chunk.content == ""
    assert chunk.finish_reason is FinishReason.LENGTH and chunk.matched_stop == ""
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.cached_tokens) == (9, 0, 4)


def test_stop_token_text_is_kept_in_content_only_when_asked(tokenizer):
    stop = encode(tokenizer, " x")[-1]  # a plain (non-special) stop token id
    for include, expected in ((False, "hi"), (True, "hi x")):
        stream = DerenderStream(tokenizer, RequestContext(include_stop_str_in_output=include))
        [chunk] = stream.feed(EngineOutput(index=0, token_ids=tuple(encode(tokenizer, "hi")) + (stop,),
                                           finish_reason=FinishReason.STOP, matched_stop_token_id=stop))
        assert chunk.content == expected and chunk.matched_stop == " x"


def test_two_choices_multiplexed(tokenizer):
    texts = ["café and 日本", "🎉 party time"]
    ids = [encode(tokenizer, t) for t in texts]
    stream = DerenderStream(tokenizer, RequestContext(n=2, prompt_tokens=5))
    rng = random.Random(3)
    positions = [0, 0]
    chunks = []
    while any(positions[i] < len(ids[i]) for i in range(2)):
        i = rng.choice([c for c in range(2) if positions[c] < len(ids[c])])
        size = rng.randint(1, 3)
        piece = tuple(ids[i][positions[i]:positions[i] + size])
        positions[i] += size
        chunks += stream.feed(EngineOutput(index=i, token_ids=piece))
    assert not stream.finished
    chunks += stream.feed(EngineOutput(index=1, finish_reason=FinishReason.STOP))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.LENGTH))
    assert stream.finished
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.content for c in mine) == texts[i]
        assert mine[0].role == "assistant" and all(c.role == "" for c in mine[1:])
        assert mine[-1].finish_reason is not None
    # The request's totals are in the last final chunk.
    assert chunks[-1].usage.completion_tokens == len(ids[0]) + len(ids[1])


def test_validation_names_the_field(tokenizer):
    stream = DerenderStream(tokenizer, RequestContext(n=2))
    with pytest.raises(InvalidArgument) as error:
        stream.feed(EngineOutput(index=2, token_ids=(1,)))
    assert error.value.field == "generate_response.index"
    with pytest.raises(InvalidArgument) as error:
        stream.feed(EngineOutput(index=0, token_ids=(5, tokenizer.vocab_size)))
    assert error.value.field == "generate_response.token_ids[1]"
    with pytest.raises(InvalidArgument) as error:
        stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP, matched_stop_token_id=10**6))
    assert error.value.field == "generate_response.matched_stop_token_id"
    stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    with pytest.raises(FailedPrecondition) as error:
        stream.feed(EngineOutput(index=0, token_ids=(5,)))
    assert error.value.field == "generate_response.index"
    with pytest.raises(InvalidArgument) as error:
        DerenderStream(tokenizer, RequestContext(prompt_tail_token_ids=(1, 99999)))
    assert error.value.field == "context.prompt_tail_token_ids[1]"


def test_full_matches_stream_and_requires_every_choice_to_finish(tokenizer):
    ids = encode(tokenizer, "whole answer 日本")
    context = RequestContext(n=2, prompt_tokens=4, text=TextOptions(skip_special_tokens=True))
    outputs = [EngineOutput(index=0, token_ids=tuple(ids[:3])), EngineOutput(index=1, token_ids=tuple(ids)),
               EngineOutput(index=0, token_ids=tuple(ids[3:]), finish_reason=FinishReason.STOP),
               EngineOutput(index=1, finish_reason=FinishReason.LENGTH)]
    choices, usage = derender_full(tokenizer, context, outputs)
    assert [c.content for c in choices] == ["whole answer 日本"] * 2
    assert [c.finish_reason for c in choices] == [FinishReason.STOP, FinishReason.LENGTH]
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 2 * len(ids))
    with pytest.raises(InvalidArgument) as error:
        derender_full(tokenizer, context, outputs[:3])
    assert error.value.field == "responses"
    with pytest.raises(InvalidArgument) as error:
        derender_full(tokenizer, context, [EngineOutput(index=0, token_ids=(99999,))])
    assert error.value.field == "responses[0].token_ids[0]"


def test_choice_count_is_bounded(tokenizer):
    from tito_derender.stream import MAX_CHOICES

    DerenderStream(tokenizer, RequestContext(n=MAX_CHOICES))
    with pytest.raises(InvalidArgument) as error:
        DerenderStream(tokenizer, RequestContext(n=100_000_000))
    assert error.value.field == "context.n" and error.value.reason == "TOO_MANY_CHOICES"
    with pytest.raises(InvalidArgument):
        derender_full(tokenizer, RequestContext(n=4_000_000_000), [])


def test_full_output_with_a_response_after_the_final_one_is_invalid(tokenizer):
    outputs = [EngineOutput(index=0, token_ids=(5,), finish_reason=FinishReason.STOP),
               EngineOutput(index=0, token_ids=(6,))]
    with pytest.raises(InvalidArgument) as error:
        derender_full(tokenizer, RequestContext(), outputs)
    assert error.value.field == "responses[1].index"
