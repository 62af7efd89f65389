"""Caller mistakes become InvalidArgument (or Unimplemented) naming the field."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from tito.config import ConfigError
from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.model import detect_parsers, resolve_context_length
from tito_render.renderer import Renderer
from tito_render.convert import chat_response, completion_response

from renderers import load_renderer


@pytest.fixture(scope="module")
def renderer(tiny_text_model) -> Renderer:
    return load_renderer(tiny_text_model)


def user(text="hi") -> chat_pb2.ChatMessage:
    return chat_pb2.ChatMessage(role="user", content=text)


def tool(name="get_weather") -> chat_pb2.Tool:
    return chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name=name))


def assistant_call(arguments: str) -> chat_pb2.ChatMessage:
    return chat_pb2.ChatMessage(role="assistant", tool_calls=[chat_pb2.ToolCall(
        id="c1", function=chat_pb2.FunctionCall(name="f", arguments=arguments))])


def kwargs_struct(obj) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


CASES = {
    "empty_messages": (dict(messages=[]), "messages"),
    "unknown_role": (dict(messages=[user(), chat_pb2.ChatMessage(role="robot", content="x")]), "messages[1].role"),
    "content_and_parts": (dict(messages=[chat_pb2.ChatMessage(
        role="user", content="a", content_parts=[chat_pb2.ContentPart(text="b")])]), "messages[0].content_parts"),
    "empty_part": (dict(messages=[chat_pb2.ChatMessage(role="user", content_parts=[chat_pb2.ContentPart()])]),
                   "messages[0].content_parts[0]"),
    "arguments_not_json": (dict(messages=[user(), assistant_call("{not json")]),
                           "messages[1].tool_calls[0].function.arguments"),
    "arguments_not_object": (dict(messages=[user(), assistant_call("[1, 2]")]),
                             "messages[1].tool_calls[0].function.arguments"),
    "tool_calls_on_user": (dict(messages=[chat_pb2.ChatMessage(role="user", content="x", tool_calls=[
        chat_pb2.ToolCall(function=chat_pb2.FunctionCall(name="f", arguments="{}"))])]), "messages[0].tool_calls"),
    "tool_without_name": (dict(messages=[user()], tools=[tool("")]), "tools[0].function.name"),
    "duplicate_tool": (dict(messages=[user()], tools=[tool("a"), tool("a")]), "tools[1].function.name"),
    "tool_choice_unknown_function": (dict(messages=[user()], tools=[tool()],
                                          tool_choice=chat_pb2.ToolChoice(function_name="nope")),
                                     "tool_choice.function_name"),
    "tool_choice_required_without_tools": (
        dict(messages=[user()], tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)),
        "tool_choice.mode"),
    "malformed_template": (dict(messages=[user()], chat_template="{% for m in messages %}{{ m.content }"),
                           "chat_template"),
    "template_raises": (dict(messages=[user()], chat_template="{{ raise_exception('only system allowed') }}"),
                        "chat_template"),
    "continue_with_generation_prompt": (dict(messages=[user()], continue_final_message=True,
                                             add_generation_prompt=True), "continue_final_message"),
    "continue_without_content": (dict(messages=[user(), chat_pb2.ChatMessage(role="assistant")],
                                      continue_final_message=True), "continue_final_message"),
    "reserved_template_kwarg": (dict(messages=[user()], chat_template_kwargs=kwargs_struct({"tokenize": False})),
                                "chat_template_kwargs.tokenize"),
    "max_tokens_beyond_context": (dict(messages=[user()], sampling=render_pb2.SamplingOptions(max_tokens=5000)),
                                  "sampling.max_tokens"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chat_errors_name_the_field(renderer, name):
    fields, field = CASES[name]
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(**fields))
    assert err.value.field == field, err.value.message


def test_the_models_own_template_refusing_the_chat_names_messages(renderer, monkeypatch):
    monkeypatch.setattr(renderer.model.tokenizer, "chat_template", "{{ raise_exception('only one turn') }}")
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=[user()]))
    assert (err.value.field, err.value.reason) == ("messages", "CHAT_TEMPLATE_ERROR")
    assert "only one turn" in err.value.message


def test_template_error_message_is_the_templates(renderer):
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(
            messages=[user()], chat_template="{{ raise_exception('only system allowed') }}"))
    assert "only system allowed" in err.value.message


def test_prompt_longer_than_context(renderer):
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=[user("word " * 3000)]))
    assert err.value.field == "messages" and "context limit 2048" in err.value.message


def test_image_part_on_text_model_is_unsupported_modality(renderer):
    part = chat_pb2.ContentPart(image=chat_pb2.ImageSource(url="file:///x.png"))
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[chat_pb2.ContentPart(text="see"), part])]))
    assert err.value.field == "messages[0].content_parts[1].image" and err.value.reason == "UNSUPPORTED_MODALITY"


def test_video_part_on_text_model_is_unsupported_modality(renderer):
    part = chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=b"x")]))
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[chat_pb2.ContentPart(text="see"), part])]))
    assert err.value.field == "messages[0].content_parts[1].video" and err.value.reason == "UNSUPPORTED_MODALITY"


def test_tool_choice_none_keeps_tools_in_prompt(renderer):
    response = chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[user()], tools=[tool()], return_prompt_text=True,
        tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_NONE)))
    assert "get_weather" in response.prompt_text
    assert response.derender_context.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NONE


@pytest.mark.parametrize("fields, field", [
    (dict(), "prompt"),
    (dict(prompt="a", prompt_token_ids=[1]), "prompt"),
    (dict(prompt_token_ids=[1, 2, 1013]), "prompt_token_ids[2]"),
    (dict(prompt=""), "prompt"),
])
def test_completion_errors(renderer, fields, field):
    with pytest.raises(InvalidArgument) as err:
        completion_response(renderer, render_pb2.RenderCompletionRequest(**fields))
    assert err.value.field == field
    if "prompt_token_ids[" not in field and fields.get("prompt") != "":
        assert [v.field for v in err.value.violations] == ["prompt", "prompt_token_ids"]


def test_config_rules(tmp_path):
    with pytest.raises(ConfigError, match="fixed port"):
        RenderConfig(workers=2, address="127.0.0.1:0").validate()
    with pytest.raises(ConfigError, match="Unix socket"):
        RenderConfig(workers=2, address="unix:/tmp/x.sock").validate()
    RenderConfig(workers=2, address="127.0.0.1:50999").validate()
    assert RenderConfig(workers=0).resolved_workers() >= 1
    with pytest.raises(ConfigError, match="workers=-1"):
        RenderConfig(workers=-1).validate()
    with pytest.raises(ConfigError, match="media_dir"):
        RenderConfig(media_dir=str(tmp_path / "missing")).validate()
    short_key = tmp_path / "key"
    short_key.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        RenderConfig(hmac_key_file=str(short_key)).validate()
    with pytest.raises(ConfigError, match="hmac_key_file"):
        RenderConfig(hmac_key_id="k1").validate()
    with pytest.raises(ConfigError, match="reasoning_parser"):
        RenderConfig(reasoning_parser="magic").validate()
    with pytest.raises(ConfigError, match="exceeds"):
        resolve_context_length(2048, 4096)
    assert resolve_context_length(2048, 512) == 512
    with pytest.raises(ConfigError, match="--max-model-len"):
        resolve_context_length(None, 0)


def test_create_server_is_single_process():
    import asyncio

    from tito_render.server import create_server

    with pytest.raises(ConfigError, match="serve"):
        asyncio.run(create_server(RenderConfig(workers=2, address="127.0.0.1:50998")))


def test_parser_detection():
    vocab = {"<think>": 1, "</think>": 2, "<tool_call>": 3}
    assert detect_parsers(vocab, "auto", "auto") == ("qwen3", "hermes")
    assert detect_parsers({}, "auto", "auto") == ("", "")
    assert detect_parsers(vocab, "none", "none") == ("", "")
    assert detect_parsers({}, "deepseek_r1", "pythonic") == ("deepseek_r1", "pythonic")


@pytest.mark.parametrize("template", [
    "{{ 1 / 0 }}",
    "{{ 10.0 ** 400 }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    '{{ "\\ud800" }}',
])
def test_template_runtime_failures_are_the_callers(renderer, template):
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, render_pb2.RenderChatRequest(messages=[user()], chat_template=template))
    assert err.value.field == "chat_template" and err.value.reason == "CHAT_TEMPLATE_ERROR"
    chat_response(renderer, render_pb2.RenderChatRequest(messages=[user()]))  # still serving
