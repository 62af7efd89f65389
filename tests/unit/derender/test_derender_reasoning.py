"""Reasoning parsers: qwen3 and deepseek_r1, complete and streamed, with the prompt-opened block
and thinking switched off."""

from __future__ import annotations

import random

import pytest

from tito_derender.domain import EngineOutput, FinishReason, OutputDelta, RequestContext
from tito_derender.parsers import reasoning_parser_for
from tito_derender.parsers.reasoning import ThinkReasoningParser
from tito_derender.stream import DerenderStream
from hf_reference import hf_of


def split(text: str, sizes) -> list[str]:
    pieces, position = [], 0
    for size in sizes:
        pieces.append(text[position:position + size])
        position += size
    pieces.append(text[position:])
    return pieces


def parse(parser: ThinkReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        out = parser.process(OutputDelta(content=piece), final=False)
        reasoning, content = reasoning + out.reasoning_content, content + out.content
    out = parser.process(OutputDelta(), final=True)
    return reasoning + out.reasoning_content, content + out.content


CASES = [
    # (parser, prompt_opens_reasoning, text, reasoning, content)
    ("qwen3", False, "<think>\nLet me think.\n</think>\n\nThe answer.", "\nLet me think.\n", "\n\nThe answer."),
    ("qwen3", False, "  \n<think>a</think>b", "a", "b"),
    ("qwen3", False, "No thinking here.", "", "No thinking here."),
    ("qwen3", False, "Text then <think>not reasoning</think>", "", "Text then <think>not reasoning</think>"),
    ("qwen3", True, "still thinking</think>done", "still thinking", "done"),
    ("qwen3", True, "cut off while thinking", "cut off while thinking", ""),
    ("qwen3", False, "<think>never closed", "never closed", ""),
    ("qwen3", False, "<thin", "", "<thin"),  # a partial marker at the very end is text
    ("qwen3", True, "a </thi", "a </thi", ""),
    ("qwen3", False, "<think>x</think>y<think>z</think>", "x", "y<think>z</think>"),  # one block only
    ("deepseek_r1", False, "reasoning first</think>answer", "reasoning first", "answer"),
    ("deepseek_r1", False, "<think>with tag</think>answer", "with tag", "answer"),
    ("deepseek_r1", False, "no end at all", "no end at all", ""),
    ("deepseek_r1", True, "</think>", "", ""),
]


@pytest.mark.parametrize("name,opens,text,reasoning,content", CASES)
def test_reasoning_table_complete_and_streamed(name, opens, text, reasoning, content):
    context = RequestContext(reasoning_parser=name, thinking_enabled=True, prompt_opens_reasoning=opens)
    assert parse(reasoning_parser_for(context), [text]) == (reasoning, content)
    assert parse(reasoning_parser_for(context), list(text)) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(5):
        sizes = [rng.randint(0, 4) for _ in range(len(text) // 2)]
        assert parse(reasoning_parser_for(context), split(text, sizes)) == (reasoning, content)


def test_thinking_off_or_no_parser_means_no_reasoning_stage():
    assert reasoning_parser_for(RequestContext(reasoning_parser="qwen3", thinking_enabled=False)) is None
    assert reasoning_parser_for(RequestContext(reasoning_parser="", thinking_enabled=True)) is None


def test_stream_with_tokens_and_thinking_off(tiny_tokenizer):
    text = "<think>hidden?</think>shown"
    ids = hf_of(tiny_tokenizer).encode(text, add_special_tokens=False)
    for thinking, reasoning, content in ((True, "hidden?", "shown"), (False, "", text)):
        stream = DerenderStream(tiny_tokenizer, RequestContext(reasoning_parser="qwen3", thinking_enabled=thinking))
        chunks = []
        for token_id in ids:
            chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
        chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
        assert "".join(c.reasoning_content for c in chunks) == reasoning
        assert "".join(c.content for c in chunks) == content
        assert chunks[0].role == "assistant"
