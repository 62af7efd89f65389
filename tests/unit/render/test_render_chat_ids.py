"""Chat rendering gives exactly the ids of tokenizer.apply_chat_template(tokenize=True) on the
equivalent OpenAI-style dicts."""

from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.convert import chat_response, completion_response, tokenize_response


@pytest.fixture(scope="module")
def renderer(tiny_text_model) -> Renderer:
    return Renderer(load_render_model(RenderConfig(model=str(tiny_text_model))))


def struct(obj: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


# A Struct is a map: key order does not survive the wire, so render sorts keys. Equivalent dicts
# here are therefore written with sorted keys.
WEATHER_PARAMS = {"properties": {"city": {"type": "string"}, "days": {"minimum": 1, "type": "integer"}},
                  "required": ["city"], "type": "object"}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": WEATHER_PARAMS}}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"properties": {}, "type": "object"}}}


def msg(role, content=None, **extra) -> dict:
    out = {"role": role}
    if content is not None:
        out["content"] = content
    out.update(extra)
    return out


def call(name, arguments, call_id="call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def to_proto_message(d: dict) -> chat_pb2.ChatMessage:
    m = chat_pb2.ChatMessage(role=d["role"], name=d.get("name", ""), tool_call_id=d.get("tool_call_id", ""))
    content = d.get("content")
    if isinstance(content, str):
        m.content = content
    elif isinstance(content, list):
        m.content_parts.extend(chat_pb2.ContentPart(text=p["text"]) for p in content)
    if "reasoning_content" in d:
        m.reasoning_content = d["reasoning_content"]
    for c in d.get("tool_calls", []):
        fn = chat_pb2.FunctionCall(name=c["function"]["name"])
        args = c["function"]["arguments"]
        if isinstance(args, str):
            fn.arguments = args
        else:
            fn.arguments_object.CopyFrom(struct(args))
        m.tool_calls.append(chat_pb2.ToolCall(id=c.get("id", ""), type="function", function=fn))
    return m


def to_proto_tool(d: dict) -> chat_pb2.Tool:
    f = d["function"]
    fn = chat_pb2.FunctionDefinition(name=f["name"], description=f.get("description", ""))
    if "parameters" in f:
        fn.parameters.CopyFrom(struct(f["parameters"]))
    return chat_pb2.Tool(type="function", function=fn)


TOOL_TURNS = [
    msg("user", "What is the weather in Paris?"),
    msg("assistant", "", tool_calls=[call("get_weather", '{"city": "Paris", "days": 2}')]),
    msg("tool", "sunny, 21C", tool_call_id="call_1"),
    msg("assistant", "It is sunny."),
    msg("user", "And 2 + 3?"),
    msg("assistant", None, tool_calls=[call("add", {"a": 2, "b": 3}, "call_2"),
                                       call("get_weather", {"city": "Rome"}, "call_3")]),
    msg("tool", "5", tool_call_id="call_2"),
    msg("tool", "rainy"),  # no tool_call_id: allowed
]

CASES = {
    "plain": dict(messages=[msg("user", "Hello there!")]),
    "system_multi_turn": dict(messages=[msg("system", "You are terse."), msg("user", "Hi"),
                                        msg("assistant", "Hello."), msg("user", "How are you?")]),
    "user_with_name": dict(messages=[msg("user", "Hi", name="alice")]),
    "tools_offered": dict(messages=[msg("user", "Weather in Oslo?")], tools=[WEATHER_TOOL, ADD_TOOL]),
    "system_with_tools": dict(messages=[msg("system", "Be helpful."), msg("user", "Weather?")],
                              tools=[WEATHER_TOOL]),
    "multi_turn_tool_calls": dict(messages=TOOL_TURNS, tools=[WEATHER_TOOL, ADD_TOOL]),
    "reasoning_content": dict(messages=[msg("user", "2+2?"),
                                        msg("assistant", "4", reasoning_content="Two and two is four."),
                                        msg("user", "3+3?")]),
    "reasoning_in_last_turn": dict(messages=[msg("user", "2+2?"),
                                             msg("assistant", "4", reasoning_content="easy")],
                                   add_generation_prompt=False),
    "thinking_off": dict(messages=[msg("user", "Quick answer please")], kwargs={"enable_thinking": False}),
    "thinking_on": dict(messages=[msg("user", "Think hard")], kwargs={"enable_thinking": True}),
    "no_generation_prompt": dict(messages=[msg("user", "Hi")], add_generation_prompt=False),
    "continue_final_message": dict(messages=[msg("user", "Count to three"), msg("assistant", "One, two,")],
                                   continue_final=True),
    "list_of_parts": dict(messages=[msg("system", [{"type": "text", "text": "Sys."}]),
                                    msg("user", [{"type": "text", "text": "Part one. "},
                                                 {"type": "text", "text": "Part two."}])]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_equal_apply_chat_template(renderer, name):
    case = CASES[name]
    tokenizer = renderer.model.tokenizer
    continue_final = case.get("continue_final", False)
    add_gen = case.get("add_generation_prompt", not continue_final)
    kwargs = case.get("kwargs", {})
    expected = tokenizer.apply_chat_template(
        case["messages"], tools=case.get("tools"), tokenize=True, add_generation_prompt=add_gen,
        continue_final_message=continue_final, **kwargs)
    expected_ids = list(expected["input_ids"] if hasattr(expected, "keys") else expected)

    request = render_pb2.RenderChatRequest(
        messages=[to_proto_message(m) for m in case["messages"]],
        tools=[to_proto_tool(t) for t in case.get("tools", [])],
        continue_final_message=continue_final, return_prompt_text=True)
    if "add_generation_prompt" in case:
        request.add_generation_prompt = case["add_generation_prompt"]
    if kwargs:
        request.chat_template_kwargs.CopyFrom(struct(kwargs))
    response = chat_response(renderer, request)
    assert list(response.generate_request.token_ids) == expected_ids
    assert response.derender_context.prompt_tokens == len(expected_ids)
    assert list(response.derender_context.prompt_tail_token_ids) == expected_ids[-8:]
    assert tokenizer.decode(expected_ids) == response.prompt_text


def test_string_arguments_are_kept_verbatim(renderer):
    """An OpenAI JSON-string `arguments` reaches the template as that same string."""
    args = '{"city":"Paris"}'  # compact spacing: re-serialising a parsed dict would change it
    messages = [msg("user", "w?"), msg("assistant", "", tool_calls=[call("get_weather", args)])]
    response = chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[to_proto_message(m) for m in messages], add_generation_prompt=False, return_prompt_text=True))
    assert '"arguments": {"city":"Paris"}}' in response.prompt_text


def test_struct_keys_are_sorted(renderer):
    tool = to_proto_tool({"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": {"y": 2, "b": 3}}}})
    response = chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[to_proto_message(msg("user", "x"))], tools=[tool], return_prompt_text=True))
    assert '"parameters": {"a": {"b": 3, "y": 2}, "z": 1}' in response.prompt_text


def test_object_arguments_keep_integers(renderer):
    messages = [msg("user", "add"), msg("assistant", "", tool_calls=[call("add", {"a": 2, "b": 0.5})])]
    response = chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[to_proto_message(m) for m in messages], add_generation_prompt=False, return_prompt_text=True))
    assert json.dumps({"a": 2, "b": 0.5}) in response.prompt_text


def test_derender_context_for_chat(renderer):
    request = render_pb2.RenderChatRequest(
        request_id="req-1", messages=[to_proto_message(msg("user", "Weather?"))],
        tools=[to_proto_tool(WEATHER_TOOL)])
    request.sampling.stop.append("END")
    request.sampling.n = 2
    request.sampling.logprobs = True
    ctx = chat_response(renderer, request).derender_context
    assert ctx.request_id == "req-1"
    assert (ctx.reasoning_parser, ctx.tool_parser) == ("qwen3", "hermes")
    assert ctx.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_AUTO
    assert [t.function.name for t in ctx.tools] == ["get_weather"]
    assert list(ctx.text_options.stop) == ["END"]
    assert ctx.thinking_enabled and not ctx.prompt_opens_reasoning
    assert ctx.n == 2 and ctx.logprobs


@pytest.mark.parametrize("asked", [True, False])
def test_usage_in_every_chunk_reaches_derenders_context(renderer, asked):
    chat = render_pb2.RenderChatRequest(messages=[to_proto_message(msg("user", "x"))], usage_in_every_chunk=asked)
    assert chat_response(renderer, chat).derender_context.usage_in_every_chunk == asked
    completion = render_pb2.RenderCompletionRequest(prompt="x", usage_in_every_chunk=asked)
    assert completion_response(renderer, completion).derender_context.usage_in_every_chunk == asked


def test_thinking_flags_follow_template_kwargs(renderer):
    request = render_pb2.RenderChatRequest(messages=[to_proto_message(msg("user", "hi"))])
    request.chat_template_kwargs.CopyFrom(struct({"enable_thinking": False}))
    assert not chat_response(renderer, request).derender_context.thinking_enabled


def test_prompt_opening_reasoning_is_detected(renderer):
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    request = render_pb2.RenderChatRequest(messages=[to_proto_message(msg("user", "hi"))], chat_template=template)
    response = chat_response(renderer, request)
    assert response.derender_context.prompt_opens_reasoning
    expected = renderer.model.tokenizer.apply_chat_template(
        [msg("user", "hi")], chat_template=template, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(response.generate_request.token_ids) == list(expected)


def test_request_id_generated_when_empty(renderer):
    response = chat_response(renderer, render_pb2.RenderChatRequest(messages=[to_proto_message(msg("user", "x"))]))
    rid = response.generate_request.request_id
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert response.derender_context.request_id == rid
    assert response.prompt_text == ""  # only on request


def test_completion_text_and_ids(renderer):
    tok = renderer.model.tokenizer
    text = completion_response(renderer, render_pb2.RenderCompletionRequest(prompt="Once upon a time"))
    assert list(text.generate_request.token_ids) == tok("Once upon a time")["input_ids"]
    assert text.derender_context.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NONE
    ids = completion_response(renderer, render_pb2.RenderCompletionRequest(prompt_token_ids=[5, 6, 7],
                                                                        cache_salt="s"))
    assert list(ids.generate_request.token_ids) == [5, 6, 7]
    assert ids.generate_request.cache_salt == "s"
    assert ids.generate_request.sampling_params.max_tokens == renderer.model.max_context_length - 3


def test_the_lora_adapter_is_copied_into_the_generate_request_and_renders_as_the_base(renderer):
    messages = [to_proto_message(msg("user", "hello"))]
    base = chat_response(renderer, render_pb2.RenderChatRequest(messages=messages))
    adapted = chat_response(renderer, render_pb2.RenderChatRequest(messages=messages, lora_name="sql-r16"))
    assert adapted.generate_request.lora_name == "sql-r16" and base.generate_request.lora_name == ""
    assert adapted.generate_request.token_ids == base.generate_request.token_ids
    completion = completion_response(renderer, render_pb2.RenderCompletionRequest(prompt="x", lora_name="chat/v2"))
    assert completion.generate_request.lora_name == "chat/v2"
    with pytest.raises(InvalidArgument) as refused:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=messages, lora_name="no spaces"))
    assert refused.value.field == "lora_name"


def test_tokenize(renderer):
    tok = renderer.model.tokenizer
    response = tokenize_response(renderer, render_pb2.TokenizeRequest(text="Hello world", return_token_strings=True))
    assert list(response.token_ids) == tok("Hello world", add_special_tokens=False)["input_ids"]
    assert list(response.token_strings) == tok.convert_ids_to_tokens(list(response.token_ids))


def test_named_and_required_tool_choice_pass_through(renderer):
    base = dict(messages=[to_proto_message(msg("user", "w?"))], tools=[to_proto_tool(WEATHER_TOOL)])
    named = chat_response(renderer, render_pb2.RenderChatRequest(
        tool_choice=chat_pb2.ToolChoice(function_name="get_weather"), **base)).derender_context
    assert named.tool_choice.function_name == "get_weather"
    required = chat_response(renderer, render_pb2.RenderChatRequest(
        tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED), **base)).derender_context
    assert required.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.text(max_size=40), min_size=1, max_size=4), thinking=st.sampled_from([None, True, False]))
def test_any_text_chat_matches_apply_chat_template(renderer, turns, thinking):
    roles = ["user", "assistant"]
    messages = [msg(roles[i % 2], text) for i, text in enumerate(turns)]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = renderer.model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                            **kwargs)["input_ids"]
    request = render_pb2.RenderChatRequest(messages=[to_proto_message(m) for m in messages])
    if kwargs:
        request.chat_template_kwargs.CopyFrom(struct(kwargs))
    assert list(chat_response(renderer, request).generate_request.token_ids) == list(expected)
