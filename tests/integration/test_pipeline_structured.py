"""Structured outputs through the real render, engine and derender services.

The tiny model's random weights write nonsense; under a response_format or a strict tool call the
same model's answer parses and validates, end to end: render turns the request's intent into the
constraint, the engine masks, derender parses what came out.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from google.protobuf import struct_pb2

from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, engine_pb2, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit", "tags"],
                 "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                "unit": {"enum": ["celsius", "fahrenheit"]},
                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}}}
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}}}


def struct(value: dict) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(value)
    return result


@pytest.fixture(scope="module")
def pipeline(tiny_text_model, module_aio_server):
    model = str(tiny_text_model)
    render = module_aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model)))
    engine = module_aio_server(lambda: create_engine(EngineConfig(address="127.0.0.1:0", model=model, device="cpu",
                                                                  max_model_len=1024)))
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model)))
    with ChatPipeline(Endpoints(render.address, engine.address, derender.address), timeout=120) as client:
        yield client


def chat(**fields) -> render_pb2.RenderChatRequest:
    fields.setdefault("sampling", render_pb2.SamplingOptions(max_tokens=200, temperature=1.0, seed=11))
    fields.setdefault("chat_template_kwargs", no_thinking())
    return render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="What is the weather in Paris this week?")], **fields)


def no_thinking() -> struct_pb2.Struct:
    """The tiny model reasons by default (a Qwen3 template): these turns skip it, so the
    constraint applies from the first token (reasoning turns: test_a_reasoning_turn_*)."""
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    return kwargs


def run(pipeline, request):
    return run_chunks(list(pipeline.stream_chat(request)))


def run_chunks(chunks):
    content = "".join(chunk.content for chunk in chunks)
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.tool_calls:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.name
            call["arguments"] += delta.arguments
    return content, calls, chunks[-1].finish_reason


def test_unconstrained_the_model_writes_no_json(pipeline):
    content, _, _ = run(pipeline, chat())
    with pytest.raises(ValueError):
        json.loads(content)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_content_validates(pipeline, seed):
    response_format = render_pb2.ResponseFormat(type="json_schema", json_schema=render_pb2.JsonSchemaResponseFormat(
        name="forecast", schema=struct(ANSWER_SCHEMA), strict=True))
    content, calls, finish = run(pipeline, chat(response_format=response_format, sampling=render_pb2.SamplingOptions(
        max_tokens=200, temperature=1.0, seed=seed)))
    assert finish == engine_pb2.FINISH_REASON_STOP and not calls
    jsonschema.validate(json.loads(content), ANSWER_SCHEMA)


def test_response_format_json_object_content_is_an_object(pipeline):
    content, _, finish = run(pipeline, chat(response_format=render_pb2.ResponseFormat(type="json_object"),
                                            sampling=render_pb2.SamplingOptions(max_tokens=300, temperature=0)))
    assert finish == engine_pb2.FINISH_REASON_STOP
    assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("tool_choice", [chat_pb2.ToolChoice(function_name="get_weather"),
                                         chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)])
def test_a_strict_tool_calls_arguments_validate(pipeline, tool_choice):
    weather = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name="get_weather", description="Weather for a city", parameters=struct(WEATHER_PARAMS), strict=True))
    other = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name="get_time", parameters=struct({"type": "object", "properties": {}, "additionalProperties": False})))
    tools = [weather] if tool_choice.WhichOneof("choice") == "mode" else [weather, other]
    # parallel_tool_calls false: exactly one call (with it true a random model may go on calling)
    _, calls, finish = run(pipeline, chat(tools=tools, tool_choice=tool_choice, parallel_tool_calls=False))
    # OpenAI's rule: a named function's forced call ends with stop, a required one with tool_calls.
    named = tool_choice.WhichOneof("choice") == "function_name"
    assert finish == (engine_pb2.FINISH_REASON_STOP if named else engine_pb2.FINISH_REASON_TOOL_CALLS)
    assert [call["name"] for call in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


def test_a_bad_response_format_is_refused_by_render_naming_the_field(pipeline):
    import grpc

    from tito.grpc_errors import error_details

    response_format = render_pb2.ResponseFormat(type="json_schema")
    with pytest.raises(grpc.RpcError) as caught:
        run(pipeline, chat(response_format=response_format))
    details = error_details(caught.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert details["fields"] == ["response_format.json_schema.schema"]


def reasoning_and_content(pipeline, request):
    chunks = list(pipeline.stream_chat(request))
    return ("".join(c.reasoning_content for c in chunks), "".join(c.content for c in chunks), chunks[-1].finish_reason)


@pytest.mark.parametrize("seed", [1])
def test_a_reasoning_turn_reasons_freely_then_its_content_validates(pipeline, seed):
    """Thinking on (the tiny model's default): the schema applies only after </think>, as in vLLM.
    A random-weight model writes </think> by chance; this seed makes it do so within max_tokens."""
    response_format = render_pb2.ResponseFormat(type="json_schema", json_schema=render_pb2.JsonSchemaResponseFormat(
        name="weather", schema=struct(WEATHER_PARAMS), strict=True))
    request = chat(response_format=response_format, chat_template_kwargs=struct({"enable_thinking": True}),
                   sampling=render_pb2.SamplingOptions(max_tokens=900, temperature=1.0, seed=seed))
    reasoning, content, finish = reasoning_and_content(pipeline, request)
    assert finish == engine_pb2.FINISH_REASON_STOP
    assert reasoning.strip()
    jsonschema.validate(json.loads(content), WEATHER_PARAMS)


@pytest.mark.parametrize("seed", [4])
def test_a_reasoning_turn_reasons_freely_then_calls_the_named_tool(pipeline, seed):
    weather = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name="get_weather", parameters=struct(WEATHER_PARAMS), strict=True))
    request = chat(tools=[weather], tool_choice=chat_pb2.ToolChoice(function_name="get_weather"),
                   chat_template_kwargs=struct({"enable_thinking": True}),
                   sampling=render_pb2.SamplingOptions(max_tokens=700, temperature=1.0, seed=seed))
    chunks = list(pipeline.stream_chat(request))
    _, calls, finish = run_chunks(chunks)
    assert finish == engine_pb2.FINISH_REASON_STOP  # a named function's call ends with stop
    assert "".join(c.reasoning_content for c in chunks).strip()
    assert [call["name"] for call in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)
