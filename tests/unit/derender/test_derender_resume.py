"""A derender stream sealed after every chunk and opened again (tito_derender.resume) gives the
chunks one live stream gives, for content, reasoning and tool calls; its sealed size stays flat
as the output grows; a changed, foreign, oversized or hostile state is refused naming the field."""

from __future__ import annotations

import io
import pickle
import zlib

import pytest

from tito.errors import InvalidArgument
from tito_derender.parsers import TOOL_PARSERS
from tito_derender.domain import EngineOutput, FinishReason, RequestContext, ToolChoiceMode
from tito_derender.resume import MAX_STATE_BYTES, VERSION, StateSealer
from tito_derender.stream import DerenderStream

AGENT = RequestContext(reasoning_parser="qwen3", tool_parser="hermes", tool_names=("get_weather",),
                       tool_choice=ToolChoiceMode.AUTO, thinking_enabled=True)
AGENT_TEXT = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def _summary(chunks) -> tuple[str, str, list[tuple[str, str]], list]:
    """Content, reasoning, calls (name, arguments) and finish reasons: what a client assembles."""
    content = "".join(c.content for c in chunks)
    reasoning = "".join(c.reasoning_content for c in chunks)
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.tool_calls:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.name
            entry[1] += call.arguments
    return content, reasoning, [tuple(v) for _, v in sorted(calls.items())], [c.finish_reason for c in chunks]


def _outputs(ids: list[int], size: int) -> list[EngineOutput]:
    groups = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [EngineOutput(index=0, token_ids=tuple(group),
                         finish_reason=FinishReason.STOP if i == len(groups) - 1 else None)
            for i, group in enumerate(groups)]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_resumed_chunks_equal_one_live_stream(tiny_tokenizer, size):
    outputs = _outputs(_ids(tiny_tokenizer, AGENT_TEXT), size)
    live = DerenderStream(tiny_tokenizer, AGENT)
    whole = [chunk for output in outputs for chunk in live.feed(output)]
    sealer = StateSealer()
    state = sealer.seal(DerenderStream(tiny_tokenizer, AGENT), tiny_tokenizer)
    resumed = []
    for output in outputs:
        stream = sealer.open(state, tiny_tokenizer)
        resumed += stream.feed(output)
        state = sealer.seal(stream, tiny_tokenizer)
    content, reasoning, calls, _ = _summary(resumed)
    assert (content, reasoning, calls) == _summary(whole)[:3]
    assert reasoning.strip() == "The user wants weather." and content.strip() == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert resumed[-1].finish_reason == FinishReason.TOOL_CALLS


def test_the_sealed_state_does_not_grow_with_the_output(tiny_tokenizer):
    sealer = StateSealer()
    stream = DerenderStream(tiny_tokenizer, AGENT)
    sizes = []
    for token in _ids(tiny_tokenizer, "<think>\nhmm\n</think>\n\n" + "the weather is fine today " * 80):
        stream.feed(EngineOutput(index=0, token_ids=(token,)))
        sizes.append(len(sealer.seal(stream, tiny_tokenizer)))
    assert len(sizes) > 300
    # Counters widen by a byte or two; held-back text and parser state do not accumulate.
    assert max(sizes[-100:]) <= sizes[50] + 16, (sizes[50], max(sizes[-100:]))


def test_changed_foreign_and_oversized_states_are_refused(tiny_tokenizer):
    sealer = StateSealer()
    state = sealer.seal(DerenderStream(tiny_tokenizer, AGENT), tiny_tokenizer)
    flipped = state[:-1] + bytes([state[-1] ^ 1])
    for bad in (flipped, StateSealer().seal(DerenderStream(tiny_tokenizer, AGENT), tiny_tokenizer),
                b"\x02" + state[1:], state[:20], b"x" * (MAX_STATE_BYTES + 1)):
        with pytest.raises(InvalidArgument) as refused:
            sealer.open(bad, tiny_tokenizer)
        assert refused.value.field == "context.resume_state"


def test_a_sealed_pickle_naming_a_foreign_callable_is_not_loaded(tiny_tokenizer):
    """Defence in depth: even with the key, only tito's classes are resolved."""
    sealer = StateSealer(b"k" * 32)
    out = io.BytesIO()
    pickle.dump(print, out)  # builtins.print: a callable outside a derender state
    payload = zlib.compress(out.getvalue())
    blob = VERSION + sealer._tag(payload) + payload
    with pytest.raises(InvalidArgument, match="cannot be read"):
        sealer.open(blob, tiny_tokenizer)


@pytest.mark.parametrize("tool_parser", sorted(TOOL_PARSERS))
def test_every_tool_parser_seals_mid_call(tiny_tokenizer, tool_parser):
    """Each parser's state (bound-method state machines, lexers) survives sealing mid-text."""
    context = RequestContext(reasoning_parser="qwen3", tool_parser=tool_parser, tool_names=("get_weather",),
                             tool_choice=ToolChoiceMode.AUTO, thinking_enabled=True)
    sealer = StateSealer()
    stream = DerenderStream(tiny_tokenizer, context)
    ids = _ids(tiny_tokenizer, AGENT_TEXT)
    stream.feed(EngineOutput(index=0, token_ids=tuple(ids[:len(ids) - 5])))
    resumed = sealer.open(sealer.seal(stream, tiny_tokenizer), tiny_tokenizer)
    assert resumed.feed(EngineOutput(index=0, token_ids=tuple(ids[len(ids) - 5:]), finish_reason=FinishReason.STOP))
