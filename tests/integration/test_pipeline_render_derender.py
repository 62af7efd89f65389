"""Render's DerenderContext alone configures derender: tools, tool parser, thinking, stop strings.

The tiny model's random weights never write tool calls, so the engine's part is played by a
scripted token stream: the tokenizer's ids for a reply with reasoning and a tool call, sent in
small messages exactly as the engine would send them.
"""

from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2
from transformers import AutoTokenizer

from tito.v1 import (
    chat_pb2,
    derender_pb2,
    derender_pb2_grpc,
    engine_pb2,
    render_pb2,
    render_pb2_grpc,
)
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TIMEOUT = 30

WEATHER_TOOL = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
    name="get_weather", description="Current weather for a city"))
WEATHER_TOOL.function.parameters.update({
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def stubs(tiny_text_model, module_aio_server):
    render = module_aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0",
                                                                  model=str(tiny_text_model))))
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0",
                                                                        model=str(tiny_text_model))))
    render_channel, derender_channel = render.channel(), derender.channel()
    yield render_pb2_grpc.RenderServiceStub(render_channel), derender_pb2_grpc.DerenderServiceStub(derender_channel)
    render_channel.close()
    derender_channel.close()


def _scripted_engine(token_ids: list[int], eos: int, step: int = 3) -> list[engine_pb2.GenerateResponse]:
    messages = [engine_pb2.GenerateResponse(token_ids=token_ids[i:i + step]) for i in range(0, len(token_ids), step)]
    messages.append(engine_pb2.GenerateResponse(
        token_ids=[eos], finish_reason=engine_pb2.FINISH_REASON_STOP, matched_stop_token_id=eos,
        usage={"prompt_tokens": 0, "completion_tokens": len(token_ids) + 1}))
    return messages


def _derender(derender, context, responses):
    requests = [derender_pb2.DerenderRequest(context=context)]
    requests += [derender_pb2.DerenderRequest(generate_response=r) for r in responses]
    return [reply.chunk for reply in derender.Derender(iter(requests), timeout=TIMEOUT)]


def _render(render, enable_thinking: bool, **sampling):
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": enable_thinking})
    return render.RenderChat(render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[WEATHER_TOOL], chat_template_kwargs=kwargs,
        sampling=render_pb2.SamplingOptions(max_tokens=64, temperature=0, **sampling)), timeout=TIMEOUT)


def test_reasoning_and_tool_call_from_render_context(stubs, tiny_text_model):
    render, derender = stubs
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model)
    rendered = _render(render, enable_thinking=True)
    context = rendered.derender_context
    assert context.tool_parser and context.reasoning_parser and context.thinking_enabled
    reply = ('<think>\nThe user wants the weather.\n</think>\n\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    ids = tokenizer.encode(reply, add_special_tokens=False)
    chunks = _derender(derender, context, _scripted_engine(ids, tokenizer.convert_tokens_to_ids("<|im_end|>")))

    reasoning = "".join(c.reasoning_content for c in chunks)
    content = "".join(c.content for c in chunks)
    assert reasoning.strip() == "The user wants the weather."
    assert "<tool_call>" not in content and "get_weather" not in content
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id and deltas[0].type == "function"
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}
    assert {d.index for d in deltas} == {0}
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS


def test_thinking_off_keeps_everything_as_content(stubs, tiny_text_model):
    render, derender = stubs
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model)
    rendered = _render(render, enable_thinking=False)
    assert not rendered.derender_context.thinking_enabled
    ids = tokenizer.encode("Sunny and mild.", add_special_tokens=False)
    chunks = _derender(derender, rendered.derender_context,
                       _scripted_engine(ids, tokenizer.convert_tokens_to_ids("<|im_end|>")))
    assert "".join(c.content for c in chunks) == "Sunny and mild."
    assert not "".join(c.reasoning_content for c in chunks)
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_STOP


def test_stop_string_from_render_cuts_output_and_asks_to_cancel(stubs, tiny_text_model):
    render, derender = stubs
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model)
    rendered = _render(render, enable_thinking=False, stop=["mild"])
    ids = tokenizer.encode("Sunny and mild, with a breeze.", add_special_tokens=False)
    chunks = _derender(derender, rendered.derender_context,
                       _scripted_engine(ids, tokenizer.convert_tokens_to_ids("<|im_end|>"), step=1))
    assert "".join(c.content for c in chunks) == "Sunny and "
    final = [c for c in chunks if c.finish_reason]
    assert len(final) == 1 and final[0].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert final[0].matched_stop == "mild" and final[0].cancel_generation
