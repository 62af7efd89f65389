"""The request's intent as a structured-output constraint for the engine.

Render is where the intent is known: OpenAI `response_format`, strict tools, `tool_choice`, or an
explicit `sampling.structured_output`. The result goes into `SamplingParams.structured_output`; the
engine owns the token masks, derender only sees text that already parses.

Which constraint, in order:
1. tool_choice REQUIRED or a named function, on a model whose tool calls render knows how to
   spell (TOOL_CALL_MARKUP: hermes): one tool call in the model's own markup, its arguments
   under the tool's parameters schema (an xgrammar structural tag). response_format is ignored
   then: this turn is a tool call, not content.
2. response_format json_schema / json_object.
3. tool_choice AUTO with at least one `strict` tool, on such a model: free text, but whatever
   follows the call marker is a well-formed call of one of the tools (triggered tags; strict
   tools' arguments validate, the others' are any JSON object).
An explicit sampling.structured_output is passed through alone: with 1 or 2 it is refused as
CONFLICTING_OPTIONS. Every constraint gets the engine's own check here (tito/structured_output.py),
so a bad schema is refused by render, naming the request's field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from tito.errors import InvalidArgument
from tito.structured_output import StructuredOutputSpec, spec_from_proto, validate
from tito.v1 import chat_pb2, render_pb2, sampling_pb2

INVALID_RESPONSE_FORMAT = "INVALID_RESPONSE_FORMAT"
RESPONSE_FORMAT_TYPES = ("", "text", "json_object", "json_schema")
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Bounded whitespace inside a tool call's JSON: a model cannot pad a call forever.
_CALL_JSON_MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ToolCallMarkup:
    """How a tool-call format wraps one call: the text before the arguments (with the name), the
    text after them, and the marker that opens any call."""

    trigger: str
    begin: Callable[[str], str]
    end: str


TOOL_CALL_MARKUP: dict[str, ToolCallMarkup] = {
    # <tool_call>\n{"name": "get_weather", "arguments": {...}}\n</tool_call> (Qwen's chat template)
    "hermes": ToolCallMarkup(trigger="<tool_call>",
                             begin=lambda name: '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
                             end="}\n</tool_call>"),
}


def resolve_structured_output(request: render_pb2.RenderChatRequest, tools: list[dict[str, Any]] | None,
                              tool_choice: chat_pb2.ToolChoice, tool_parser: str
                              ) -> sampling_pb2.StructuredOutput | None:
    """The constraint for a chat request (None: unconstrained), checked; raise InvalidArgument
    naming the request's field for a bad one."""
    explicit = explicit_structured_output(request.sampling)
    from_format = _from_response_format(request) if request.HasField("response_format") else None
    markup = TOOL_CALL_MARKUP.get(tool_parser)
    forced_call = tools and markup is not None and (
        tool_choice.WhichOneof("choice") == "function_name" or tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED)
    if explicit is not None and (forced_call or from_format is not None):
        raise InvalidArgument(
            "sampling.structured_output cannot be combined with response_format or a required tool call; "
            "send one of them", reason="CONFLICTING_OPTIONS", field="sampling.structured_output")
    if explicit is not None:
        return explicit
    if forced_call:
        names = [tool_choice.function_name] if tool_choice.WhichOneof("choice") == "function_name" else None
        return _tool_calls(tools, markup, names, "tool_choice")
    if from_format is not None:
        return from_format
    if tools and markup is not None and tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_AUTO and any(
            tool["function"].get("strict") for tool in tools):
        return _tool_calls(tools, markup, None, "tools", triggered=True)
    return None


def explicit_structured_output(sampling: render_pb2.SamplingOptions) -> sampling_pb2.StructuredOutput | None:
    """The caller's own sampling.structured_output, checked (None when absent or empty)."""
    if not sampling.HasField("structured_output"):
        return None
    spec = spec_from_proto(sampling.structured_output)
    if spec is None:
        return None
    validate(spec, field=f"sampling.structured_output.{spec.kind}")
    return sampling.structured_output


def _from_response_format(request: render_pb2.RenderChatRequest) -> sampling_pb2.StructuredOutput | None:
    response_format = request.response_format
    kind = response_format.type
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidArgument(f"response_format.type {kind!r} is not supported; use text, json_object or json_schema",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.type")
    if kind != "json_schema" and response_format.HasField("json_schema"):
        raise InvalidArgument(f"response_format.json_schema needs type json_schema (got {kind or 'text'!r})",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.json_schema")
    if kind == "json_object":
        return sampling_pb2.StructuredOutput(json_object=sampling_pb2.JsonObjectConstraint())
    if kind != "json_schema":
        return None
    if not response_format.json_schema.HasField("schema"):
        raise InvalidArgument("response_format type json_schema needs json_schema.schema (a JSON Schema object)",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.json_schema.schema")
    from tito_render.messages import request_struct

    field = "response_format.json_schema.schema"
    schema = json.dumps(request_struct(response_format.json_schema.schema, field))
    validate(StructuredOutputSpec("json_schema", schema), field=field)
    return sampling_pb2.StructuredOutput(json_schema=schema)


def _tool_calls(tools: list[dict[str, Any]], markup: ToolCallMarkup, names: list[str] | None, field: str,
                triggered: bool = False) -> sampling_pb2.StructuredOutput:
    """A structural tag: one call of the named tool (or of any tool), or with `triggered`, free
    text in which every call is well formed."""
    tags = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        if names is not None and function["name"] not in names:
            continue
        strict = not triggered or function.get("strict")
        schema = (function.get("parameters") or ANY_OBJECT) if strict else ANY_OBJECT
        if schema is not ANY_OBJECT:
            validate(StructuredOutputSpec("json_schema", json.dumps(schema)),
                     field=f"tools[{index}].function.parameters")
        tags.append({"type": "tag", "begin": markup.begin(function["name"]),
                     "content": {"type": "json_schema", "json_schema": schema,
                                 "max_whitespace_cnt": _CALL_JSON_MAX_WHITESPACE},
                     "end": markup.end})
    if triggered:
        tag_format: dict[str, Any] = {"type": "triggered_tags", "triggers": [markup.trigger], "tags": tags}
    else:
        tag_format = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    structural_tag = json.dumps({"type": "structural_tag", "format": tag_format})
    validate(StructuredOutputSpec("structural_tag", structural_tag), field=field)
    return sampling_pb2.StructuredOutput(structural_tag=structural_tag)
