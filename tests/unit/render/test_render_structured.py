"""Render turns response_format, strict tools and tool_choice into the engine's structured output."""

from __future__ import annotations

import json

import pytest
import xgrammar
from google.protobuf import struct_pb2
from transformers import AutoTokenizer

from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, render_pb2, sampling_pb2
from tito_render.config import RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.convert import chat_response, completion_response

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 5},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def renderer(tiny_text_model) -> Renderer:
    model = load_render_model(RenderConfig(model=str(tiny_text_model)))
    assert model.tool_parser == "hermes"
    return Renderer(model)


@pytest.fixture(scope="module")
def matcher_for(tiny_text_model):
    """A matcher of the constraint render emitted, on the model's vocabulary (what the engine builds)."""
    from tito.structured_output import grammar_of, spec_from_proto

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))

    def build(constraint: sampling_pb2.StructuredOutput):
        return xgrammar.GrammarMatcher(compiler.compile_grammar(grammar_of(spec_from_proto(constraint))))
    return build


def struct(obj: dict) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(obj)
    return value


def chat(**fields) -> render_pb2.RenderChatRequest:
    """A turn without reasoning (the tiny model's Qwen3 template thinks by default): the
    constraint applies from the first token."""
    fields.setdefault("chat_template_kwargs", struct({"enable_thinking": False}))
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="hi")], **fields)


def weather_tool(strict: bool | None = None) -> chat_pb2.Tool:
    function = chat_pb2.FunctionDefinition(name="get_weather", parameters=struct(WEATHER_PARAMS))
    if strict is not None:
        function.strict = strict
    return chat_pb2.Tool(type="function", function=function)


def add_tool() -> chat_pb2.Tool:
    return chat_pb2.Tool(function=chat_pb2.FunctionDefinition(name="add", parameters=struct({"type": "object"})))


def constraint_of(renderer, request) -> sampling_pb2.StructuredOutput | None:
    params = chat_response(renderer, request).generate_request.sampling_params
    return params.structured_output if params.HasField("structured_output") else None


def accepts(matcher, text: str) -> bool:
    return matcher.accept_string(text) and matcher.is_completed()


def test_no_response_format_and_text_leave_the_output_free(renderer):
    assert constraint_of(renderer, chat()) is None
    assert constraint_of(renderer, chat(response_format=render_pb2.ResponseFormat(type="text"))) is None


def test_json_schema_and_json_object(renderer):
    response_format = render_pb2.ResponseFormat(type="json_schema", json_schema=render_pb2.JsonSchemaResponseFormat(
        name="grade", schema=struct(SCHEMA), strict=True))
    constraint = constraint_of(renderer, chat(response_format=response_format))
    assert json.loads(constraint.json_schema) == SCHEMA  # integers stay integers through the Struct
    constraint = constraint_of(renderer, chat(response_format=render_pb2.ResponseFormat(type="json_object")))
    assert constraint.WhichOneof("constraint") == "json_object"


@pytest.mark.parametrize("response_format, field", [
    (render_pb2.ResponseFormat(type="yaml"), "response_format.type"),
    (render_pb2.ResponseFormat(type="json_schema"), "response_format.json_schema.schema"),
    (render_pb2.ResponseFormat(type="json_object", json_schema=render_pb2.JsonSchemaResponseFormat(
        schema=struct(SCHEMA))), "response_format.json_schema"),
    (render_pb2.ResponseFormat(type="json_schema", json_schema=render_pb2.JsonSchemaResponseFormat(
        schema=struct({"type": "strin"}))), "response_format.json_schema.schema"),
])
def test_a_bad_response_format_is_invalid_argument_naming_the_field(renderer, response_format, field):
    with pytest.raises(InvalidArgument) as caught:
        chat_response(renderer, chat(response_format=response_format))
    assert caught.value.violations[0].field == field


def test_a_named_tool_call_is_the_hermes_markup_around_the_arguments_schema(renderer, matcher_for):
    request = chat(tools=[weather_tool(), add_tool()], tool_choice=chat_pb2.ToolChoice(function_name="get_weather"),
                   response_format=render_pb2.ResponseFormat(type="json_object"))  # ignored: this turn is a call
    constraint = constraint_of(renderer, request)
    assert constraint.WhichOneof("constraint") == "structural_tag"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    assert accepts(matcher_for(constraint), call)
    assert not accepts(matcher_for(constraint), call.replace('"unit": "c"', '"unit": "k"'))
    assert not accepts(matcher_for(constraint), call.replace("get_weather", "add"))
    assert not accepts(matcher_for(constraint), "It is sunny.")


def test_required_allows_a_call_of_any_tool(renderer, matcher_for):
    request = chat(tools=[weather_tool(), add_tool()],
                   tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED))
    constraint = constraint_of(renderer, request)
    assert accepts(matcher_for(constraint), '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert accepts(matcher_for(constraint),
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>')
    assert not accepts(matcher_for(constraint), "no call")


def test_auto_with_a_strict_tool_lets_text_through_but_checks_calls(renderer, matcher_for):
    assert constraint_of(renderer, chat(tools=[weather_tool()])) is None  # not strict: free
    constraint = constraint_of(renderer, chat(tools=[weather_tool(strict=True), add_tool()]))
    assert accepts(matcher_for(constraint), "Let me check.")
    assert accepts(matcher_for(constraint),
                   'Sure. <tool_call>\n'
                   '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>')
    assert not matcher_for(constraint).accept_string(
        '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}')


def test_an_explicit_constraint_passes_through_checked_and_conflicts_are_refused(renderer):
    sampling = render_pb2.SamplingOptions(structured_output=sampling_pb2.StructuredOutput(regex="[a-z]+"))
    assert constraint_of(renderer, chat(sampling=sampling)).regex == "[a-z]+"
    completion = completion_response(renderer, render_pb2.RenderCompletionRequest(prompt="x", sampling=sampling))
    assert completion.generate_request.sampling_params.structured_output.regex == "[a-z]+"
    with pytest.raises(InvalidArgument) as caught:
        chat_response(renderer, chat(sampling=render_pb2.SamplingOptions(
            structured_output=sampling_pb2.StructuredOutput(regex="a(b"))))
    assert caught.value.violations[0].field == "sampling.structured_output.regex"
    with pytest.raises(InvalidArgument) as caught:
        chat_response(renderer, chat(sampling=sampling, response_format=render_pb2.ResponseFormat(type="json_object")))
    assert caught.value.reason == "CONFLICTING_OPTIONS"


def test_a_tool_whose_parameters_cannot_compile_is_named(renderer):
    bad = chat_pb2.Tool(function=chat_pb2.FunctionDefinition(name="f", parameters=struct({"type": "strin"})))
    with pytest.raises(InvalidArgument) as caught:
        chat_response(renderer, chat(tools=[add_tool(), bad], tool_choice=chat_pb2.ToolChoice(function_name="f")))
    assert caught.value.violations[0].field == "tools[1].function.parameters"


def test_with_thinking_on_the_constraint_starts_after_the_reasoning(renderer, matcher_for):
    response_format = render_pb2.ResponseFormat(type="json_object")
    thinking = constraint_of(renderer, chat(response_format=response_format,
                                            chat_template_kwargs=struct({"enable_thinking": True})))
    assert thinking.WhichOneof("constraint") == "structural_tag"
    assert accepts(matcher_for(thinking), '<think>\nLet me see.\n</think>\n\n{"a": 1}')
    assert not accepts(matcher_for(thinking), '{"a": 1}')
    assert not accepts(matcher_for(thinking), "<think>\nLet me see.\n</think>\n\nSure.")
    plain = constraint_of(renderer, chat(response_format=response_format))  # enable_thinking false
    assert plain.WhichOneof("constraint") == "json_object"


def test_reasoning_start_follows_the_prompt():
    from tito_render.structured import ReasoningStart, reasoning_start

    assert reasoning_start("qwen3", True, "<|im_start|>assistant\n") == ReasoningStart("qwen3")
    assert reasoning_start("qwen3", True, "<|im_start|>assistant\n<think>\n") == ReasoningStart("qwen3", opened=True)
    assert reasoning_start("qwen3", True, "assistant\n<think>\n\n</think>\n\n") is None  # the template closed it
    assert reasoning_start("qwen3", False, "<|im_start|>assistant\n") is None
    assert reasoning_start("", True, "<|im_start|>assistant\n") is None
    assert reasoning_start("gpt_oss", True, "<|start|>assistant") == ReasoningStart("gpt_oss")
