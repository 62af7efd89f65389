"""The streams of one DerenderBatch call (tito_derender.batch.StreamSet): the open-stream limit,
late entries of ended streams ignored, ids reusable once ended, every end reported once."""

from __future__ import annotations

import pytest

from tito.errors import InvalidArgument, ResourceExhausted
from tito_derender.batch import StreamSet
from tito_derender.domain import EngineOutput, FinishReason, RequestContext
from tito_derender.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    return TextTokenizer.load(tiny_text_model)


def test_streams_end_once_each_and_ids_are_reusable_after(tokenizer):
    ended: list[tuple[bool, int]] = []
    streams = StreamSet(lambda: tokenizer, lambda stream, chunks: ended.append((stream is not None, chunks)),
                        max_open=2)
    streams.open(1, RequestContext())
    streams.open(2, RequestContext())
    with pytest.raises(ResourceExhausted) as full:
        streams.open(3, RequestContext())
    assert full.value.reason == "TOO_MANY_STREAMS"
    streams.refused(3)
    with pytest.raises(InvalidArgument) as twice:
        streams.open(1, RequestContext())
    assert twice.value.reason == "STREAM_ALREADY_OPEN"
    streams.refused(1)  # the open stream is left to end(), not counted as refused
    assert len(streams) == 2 and ended == [(False, 0)]
    assert streams.feed(1, EngineOutput(index=0, token_ids=(300,)))[1] is False
    chunks, finished = streams.feed(1, EngineOutput(index=0, token_ids=(301,), finish_reason=FinishReason.LENGTH))
    assert finished and chunks[-1].finish_reason == FinishReason.LENGTH
    assert len(streams) == 1 and ended[-1][0]  # ended by its last choice
    assert streams.feed(1, EngineOutput(index=0, token_ids=(302,))) == ([], False)  # a late entry: ignored
    assert streams.end(2) is True
    assert streams.end(2) is False  # a second close of an ended stream changes nothing
    assert len(streams) == 0 and len(ended) == 3
    with pytest.raises(InvalidArgument) as never:
        streams.feed(4, EngineOutput(index=0, token_ids=(5,)))
    assert never.value.reason == "CONTEXT_REQUIRED"
    streams.open(1, RequestContext())  # an ended id opens a new stream
    streams.end_all()
    assert len(streams) == 0 and len(ended) == 4
