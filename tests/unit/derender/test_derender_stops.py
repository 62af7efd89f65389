"""Stop strings: held back only while they could match, cut (or kept), matched across messages,
and nothing after the stop leaks. Unit level (the matcher) and stream level (with tokens)."""

from __future__ import annotations

import pytest

from tito_derender.domain import EngineOutput, FinishReason, RequestContext
from tito.stop_strings import StopMatch, StopStringMatcher
from tito_derender.stream import DerenderStream
from hf_reference import hf_of


def run(stops, pieces, include=False):
    """Feed pieces; return (emitted text, matched stop or None, pieces fed before the match ended it)."""
    matcher = StopStringMatcher(stops, include)
    emitted = ""
    for count, piece in enumerate(pieces, 1):
        result = matcher.feed(piece)
        if isinstance(result, StopMatch):
            return emitted + result.text, result.stop, count
        emitted += result
    return emitted + matcher.flush(), None, len(pieces)


CASES = [
    # (stops, pieces, include, expected text, expected stop, pieces consumed)
    (["STOP"], ["Hello ST", "O", "P and more"], False, "Hello ", "STOP", 3),  # split across three messages
    (["STOP"], ["Hello ST", "O", "P and more"], True, "Hello STOP", "STOP", 3),
    (["abc", "abcdef"], ["xx ab", "cdef yy"], False, "xx ", "abc", 2),  # a prefix of another: the first complete wins
    (["abcdef", "cd"], ["ab", "cdef"], False, "ab", "cd", 2),  # ends first wins, whatever the split
    (["abcdef", "cd"], ["abcdef"], False, "ab", "cd", 1),
    (["aab"], ["a", "a", "a", "b", "tail"], False, "a", "aab", 4),  # overlapping candidates
    (["xyz", "yzw"], ["xy", "zw"], False, "", "xyz", 2),  # overlapping stops: same end? no: xyz ends first
    (["yzw", "xyz"], ["xy", "zw"], False, "", "xyz", 2),  # order of the list does not matter
    (["bcd", "abcd"], ["abcd"], False, "", "abcd", 1),  # same end: the one starting earliest
    (["STOP"], ["no st", "op here, S", "TO"], False, "no stop here, STO", None, 3),  # released at the end
    (["\n\n"], ["line\n", "\nnext"], False, "line", "\n\n", 2),
    (["日本"], ["x日", "本y"], True, "x日本", "日本", 2),
    ([""], ["anything"], False, "anything", None, 1),  # empty stop strings are ignored
]


@pytest.mark.parametrize("stops,pieces,include,text,stop,consumed", CASES)
def test_stop_string_table(stops, pieces, include, text, stop, consumed):
    assert run(stops, pieces, include) == (text, stop, consumed)


def test_text_is_held_only_while_it_could_start_a_stop():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("value </ans") == "value "
    assert matcher.held == "</ans"
    assert matcher.feed("wer?") == "</answer?"  # could no longer match: released at once
    assert matcher.held == ""
    assert matcher.feed("a < b") == "a < b"  # "<" alone could start "</answer>"? no: "< " cannot


def test_every_split_of_the_text_gives_the_same_result():
    text = "the end is near: END OF STORY, then more"
    stops = ["END OF", "END OF STORY", "near:!"]
    expected = ("the end is near: ", "END OF")
    for first in range(len(text) + 1):
        for second in range(first, len(text) + 1, 3):
            result = run(stops, [text[:first], text[first:second], text[second:]])
            assert result[:2] == expected, (first, second)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def test_stream_cancels_and_ignores_later_messages(tokenizer):
    ids = hf_of(tokenizer).encode("Sure. The answer is 42. Done and then more text", add_special_tokens=False)
    stream = DerenderStream(tokenizer, RequestContext(stop=("Done",), prompt_tokens=5))
    chunks = []
    for token_id in ids:
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    # Later engine messages (the engine had not seen the cancel) are ignored, final one included.
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.ABORT))
    content = "".join(c.content for c in chunks)
    assert content == "Sure. The answer is 42. "
    final = [c for c in chunks if c.finish_reason is not None]
    assert len(final) == 1 and final[0] is chunks[-1]
    last = final[0]
    assert (last.finish_reason, last.matched_stop, last.cancel_generation) == (FinishReason.STOP, "Done", True)
    assert last.usage.completion_tokens <= len(ids) and last.usage.prompt_tokens == 5
    assert stream.finished


def test_stop_in_the_engines_last_message_needs_no_cancel(tokenizer):
    ids = hf_of(tokenizer).encode("abc STOP xyz", add_special_tokens=False)
    stream = DerenderStream(tokenizer, RequestContext(stop=("STOP",), include_stop_str_in_output=True))
    [chunk] = stream.feed(EngineOutput(index=0, token_ids=tuple(ids), finish_reason=FinishReason.LENGTH))
    assert (chunk.content, chunk.finish_reason, chunk.matched_stop) == ("abc STOP", FinishReason.STOP, "STOP")
    assert not chunk.cancel_generation


def test_stop_strings_apply_inside_reasoning(tokenizer):
    ids = hf_of(tokenizer).encode("<think>I think STOP here</think>answer", add_special_tokens=False)
    context = RequestContext(stop=("STOP",), reasoning_parser="qwen3", thinking_enabled=True)
    stream = DerenderStream(tokenizer, context)
    chunks = []
    for token_id in ids:
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    assert "".join(c.reasoning_content for c in chunks) == "I think "
    assert "".join(c.content for c in chunks) == ""
    assert chunks[-1].matched_stop == "STOP" and chunks[-1].cancel_generation


def test_n2_one_choice_stops_the_other_goes_on(tokenizer):
    stream = DerenderStream(tokenizer, RequestContext(stop=("halt",), n=2))
    a = hf_of(tokenizer).encode("we halt now", add_special_tokens=False)
    b = hf_of(tokenizer).encode("we continue", add_special_tokens=False)
    chunks = stream.feed(EngineOutput(index=0, token_ids=tuple(a)))
    chunks += stream.feed(EngineOutput(index=1, token_ids=tuple(b)))
    chunks += stream.feed(EngineOutput(index=0, token_ids=tuple(a)))  # ignored
    assert not stream.finished
    chunks += stream.feed(EngineOutput(index=1, finish_reason=FinishReason.STOP))
    assert stream.finished
    assert "".join(c.content for c in chunks if c.index == 0) == "we "
    assert "".join(c.content for c in chunks if c.index == 1) == "we continue"
    # Cancelling the engine stream would cut choice 1 off: the flag waits until it has finished.
    assert [(c.index, c.cancel_generation) for c in chunks if c.finish_reason] == [(0, False), (1, True)]
