"""The servicer's conversion (convert.py) and the domain below it: the wire request becomes plain
values that lose nothing the domain or the response needs, and the domain runs on those values
alone, its refusals still naming the request's fields."""

from __future__ import annotations

import math

import pytest
from google.protobuf import struct_pb2

from tito.errors import InvalidArgument
from tito.structured_output import StructuredOutputSpec
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2, sampling_pb2
from tito_render.convert import sampling_options_from_proto, struct_from_proto, structured_output_to_proto
from tito_render.domain import (ChatMessage, ChatRequest, FunctionCall, FunctionDefinition, ImagePart, ImageSource,
                                MmPayload, Modality, ResponseFormat, SamplingOptions, TextPart, Tool, ToolCall,
                                ToolChoice, ToolChoiceMode)
from tito_render.messages import collect_media, messages_to_dicts, resolve_tool_choice, tools_to_dicts
from tito_render.sampling import SamplingLimits, resolve_sampling
from tito_render.structured import resolve_structured_output


@pytest.mark.parametrize("domain, wire, prefix", [
    (Modality, multimodal_pb2.Modality, "MODALITY_"),
    (MmPayload, multimodal_pb2.MmPayload, "MM_PAYLOAD_"),
    (ToolChoiceMode, chat_pb2.ToolChoiceMode, "TOOL_CHOICE_MODE_"),
])
def test_domain_enums_carry_the_contract_numbers(domain, wire, prefix):
    assert {prefix + member.name: member.value for member in domain} == dict(wire.items())


@pytest.mark.parametrize("constraint", [
    sampling_pb2.StructuredOutput(json_schema='{"type": "object"}'),
    sampling_pb2.StructuredOutput(json_object=sampling_pb2.JsonObjectConstraint()),
    sampling_pb2.StructuredOutput(regex="[a-z]+"),
    sampling_pb2.StructuredOutput(choice=sampling_pb2.ChoiceConstraint(choices=["yes", "no", "naïve \"quoted\""])),
    sampling_pb2.StructuredOutput(grammar='root ::= "a"'),
    sampling_pb2.StructuredOutput(structural_tag='{"type": "structural_tag", "format": {"type": "any_text"}}'),
], ids=lambda constraint: constraint.WhichOneof("constraint"))
def test_an_explicit_constraint_reaches_the_engine_as_sent(constraint):
    options = sampling_options_from_proto(render_pb2.SamplingOptions(structured_output=constraint))
    sent = sampling_pb2.StructuredOutput()
    structured_output_to_proto(options.structured_output, sent)
    assert sent == constraint


def test_a_struct_arrives_as_plain_values_unchecked():
    """Checking (depth, NaN, ints, key order) is the domain's, where it always was."""
    struct = struct_pb2.Struct()
    struct.update({"n": 1, "list": [1.5, None, True, "s", {"k": []}]})
    struct.fields["nan"].number_value = math.nan
    struct.fields["unset"].SetInParent()  # a Value with no kind reads as null
    plain = struct_from_proto(struct)
    assert plain["list"] == [1.5, None, True, "s", {"k": []}] and plain["unset"] is None
    assert isinstance(plain["n"], float) and math.isnan(plain["nan"])


def test_the_domain_runs_on_plain_values():
    """No message anywhere: the chat's dicts, its tool choice, its sampling and its constraint."""
    messages = (ChatMessage("user", content_parts=(TextPart("Weather here?"), ImagePart(ImageSource(data=b"png")))),
                ChatMessage("assistant", tool_calls=(ToolCall(id="c0", function=FunctionCall(
                    "get_weather", arguments_object={"days": 2.0, "city": "Paris"})),)))
    assert messages_to_dicts(messages) == [
        {"role": "user", "content": [{"type": "text", "text": "Weather here?"}, {"type": "image"}]},
        {"role": "assistant", "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}]
    (image,) = collect_media(messages, max_images=4, max_video_frames=4)
    assert (image.field, image.source.data) == ("messages[0].content_parts[1].image", b"png")
    tools = (Tool(function=FunctionDefinition("get_weather", parameters={"type": "object"}, strict=True)),)
    assert resolve_tool_choice(ToolChoice(), tools) == ToolChoice(mode=ToolChoiceMode.AUTO)
    params = resolve_sampling(SamplingOptions(temperature=0.0, stop=("END",)), SamplingLimits(10, 100, 1000))
    assert (params.temperature, params.text_options.stop, params.max_tokens) == (0.0, ("END",), 90)
    request = ChatRequest(messages=messages, tools=tools, response_format=ResponseFormat("json_object"))
    assert resolve_structured_output(request, tools_to_dicts(tools), ToolChoice(mode=ToolChoiceMode.AUTO),
                                     "hermes") == StructuredOutputSpec("json_object")


@pytest.mark.parametrize("call, field", [
    (lambda: messages_to_dicts((ChatMessage("robot", content="hi"),)), "messages[0].role"),
    (lambda: resolve_tool_choice(ToolChoice(mode=7), ()), "tool_choice.mode"),
    (lambda: resolve_sampling(SamplingOptions(logit_bias={5: 1.0}), SamplingLimits(10, 100, 5)),
     "sampling.logit_bias[5]"),
    (lambda: tools_to_dicts((Tool(function=FunctionDefinition("f", parameters={"x": [math.inf]})),)),
     "tools[0].function.parameters"),
])
def test_domain_refusals_name_the_request_fields(call, field):
    with pytest.raises(InvalidArgument) as refused:
        call()
    assert field in [refused.value.field, *(violation.field for violation in refused.value.violations)]
