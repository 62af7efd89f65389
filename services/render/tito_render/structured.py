"""The request's intent as a structured-output constraint for the engine.

Render is where the intent is known: OpenAI `response_format`, strict tools, `tool_choice`, or an
explicit `sampling.structured_output`. The result (a `StructuredOutputSpec`) goes into
`SamplingParams.structured_output`; the engine owns the token masks, derender only sees text that already parses.

Which constraint, in order:
1. tool_choice REQUIRED or a named function, on a model whose tool calls render knows how to
   spell (tool_markup.MARKUPS: every tool format derender parses but pythonic): tool calls in
   the model's own markup, each call's arguments under its tool's parameters schema (an xgrammar
   structural tag). REQUIRED: one or more calls (exactly one with parallel_tool_calls false); a
   named function: one call of it. response_format is ignored then: this turn is a tool call.
2. response_format json_schema / json_object.
3. tool_choice AUTO with at least one `strict` tool, on a model whose markup has a call trigger:
   free text, but whatever follows the trigger is well-formed calls of the tools (triggered tags;
   strict tools' arguments validate, the others' are any JSON object).
An explicit sampling.structured_output is passed through: with 1 or 2 it is refused as
CONFLICTING_OPTIONS.

Reasoning models: when the turn starts with reasoning (`ReasoningStart`: the reasoning parser is
on and the prompt leaves thinking on), the constraint is wrapped in a structural tag that lets the
reasoning run free until it ends and applies the constraint after: `<think>` (unless the prompt
opened it) ... `</think>` and up to two whitespace characters for the think-tag formats; an
optional harmony analysis message, then the final channel's header for a content constraint, for
gpt-oss. Reasoning therefore still lands in reasoning_content and the constrained text in
content (or the tool calls). Every constraint gets the engine's own check here
(tito/structured_output.py), so a bad schema is refused by render, naming the request's field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tito.errors import InvalidArgument
from tito.structured_output import StructuredOutputSpec, validate

from tito_render.domain import ChatRequest, SamplingOptions, ToolChoice, ToolChoiceMode
from tito_render.tool_markup import (CALL_JSON_MAX_WHITESPACE, MARKUPS, Format, ToolMarkup, calls_format,
                                    xml_grammar)

INVALID_RESPONSE_FORMAT = "INVALID_RESPONSE_FORMAT"
RESPONSE_FORMAT_TYPES = ("", "text", "json_object", "json_schema")
ANY_OBJECT: dict[str, Any] = {"type": "object"}
THINK_START, THINK_END = "<think>", "</think>"
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")
HARMONY_FINAL = "<|channel|>final<|message|>"


@dataclass(frozen=True)
class ReasoningStart:
    """How a turn begins with reasoning, before any constraint applies. `parser` is the
    reasoning parser ("qwen3" / "deepseek_r1": a think block; "gpt_oss": harmony channels);
    `opened`: the prompt already opened the think block."""

    parser: str
    opened: bool = False


def reasoning_start(reasoning_parser: str, thinking_enabled: bool, prompt_text: str) -> ReasoningStart | None:
    """The reasoning this turn starts with (None: none; the constraint applies from the first
    token). A prompt that ends inside `<think>` opened the block; one that ends with `</think>`
    (thinking switched off by the template) or thinking off means none."""
    if reasoning_parser == "gpt_oss":
        return ReasoningStart("gpt_oss")
    if reasoning_parser not in ("qwen3", "deepseek_r1"):
        return None
    tail = prompt_text.rstrip()
    opened = tail.rfind(THINK_START) > tail.rfind(THINK_END)
    if opened:
        return ReasoningStart(reasoning_parser, opened=True)
    if not thinking_enabled or tail.endswith(THINK_END):
        return None
    return ReasoningStart(reasoning_parser)


def resolve_structured_output(request: ChatRequest, tools: list[dict[str, Any]] | None,
                              tool_choice: ToolChoice, tool_markup: str,
                              reasoning: ReasoningStart | None = None) -> StructuredOutputSpec | None:
    """The constraint for a chat request (None: unconstrained), checked; raise InvalidArgument
    naming the request's field for a bad one. `tool_markup`: the model's MARKUPS key."""
    explicit = explicit_structured_output(request.sampling)
    from_format = _from_response_format(request) if request.response_format is not None else None
    markup = MARKUPS.get(tool_markup)
    forced_call = tools and markup is not None and (
        tool_choice.function_name is not None or tool_choice.mode == ToolChoiceMode.REQUIRED)
    if explicit is not None and (forced_call or from_format is not None):
        raise InvalidArgument(
            "sampling.structured_output cannot be combined with response_format or a required tool call; "
            "send one of them", reason="CONFLICTING_OPTIONS", field="sampling.structured_output")
    parallel = request.parallel_tool_calls is None or request.parallel_tool_calls
    if forced_call:
        named = tool_choice.function_name is not None
        names = [tool_choice.function_name] if named else None
        return _tool_calls(tools, markup, names, "tool_choice", parallel and not named, reasoning=reasoning)
    constraint = explicit if explicit is not None else from_format
    if constraint is not None:
        return after_reasoning(constraint, reasoning) if reasoning is not None else constraint
    if tools and markup is not None and markup.trigger and tool_choice.mode == ToolChoiceMode.AUTO and any(
            tool["function"].get("strict") for tool in tools):
        return _tool_calls(tools, markup, None, "tools", parallel, triggered=True, reasoning=reasoning)
    return None


def after_reasoning(constraint: StructuredOutputSpec, reasoning: ReasoningStart) -> StructuredOutputSpec:
    """`constraint` applied only once the turn's reasoning has ended (a structural tag). A
    structural tag in xgrammar's legacy form (structures / triggers) cannot be nested: it is kept
    as it is, from the first token."""
    body = _as_format(constraint)
    if body is None:
        return constraint
    if reasoning.parser == "gpt_oss":
        body = {"type": "sequence", "elements": [{"type": "const_string", "value": HARMONY_FINAL}, body]}
    tag = json.dumps({"type": "structural_tag", "format": _reasoning_then(reasoning, body)})
    spec = StructuredOutputSpec("structural_tag", tag)
    validate(spec, field="sampling.structured_output")
    return spec


def _reasoning_then(reasoning: ReasoningStart | None, body: Format) -> Format:
    if reasoning is None:
        return body
    if reasoning.parser == "gpt_oss":
        begin, end = HARMONY_ANALYSIS
        prefix: Format = {"type": "optional", "content": {"type": "tag", "begin": begin,
                                                         "content": {"type": "any_text"}, "end": end}}
    else:
        prefix = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "" if reasoning.opened else THINK_START, "content": {"type": "any_text"},
             "end": THINK_END},
            {"type": "regex", "pattern": "[ \\n]{0,2}"}]}
    return {"type": "sequence", "elements": [prefix, body]}


def _as_format(constraint: StructuredOutputSpec) -> Format | None:
    """A constraint as a structural-tag format (None for a legacy-form structural tag)."""
    kind = constraint.kind
    if kind in ("json_schema", "json_object"):
        schema = json.loads(constraint.value) if kind == "json_schema" else ANY_OBJECT
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": CALL_JSON_MAX_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": constraint.value}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(constraint.value)]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": constraint.value}
    tag = json.loads(constraint.value)
    return tag.get("format") if isinstance(tag, dict) and tag.get("type") == "structural_tag" else None


def explicit_structured_output(sampling: SamplingOptions) -> StructuredOutputSpec | None:
    """The caller's own sampling.structured_output, checked (None when absent or empty)."""
    spec = sampling.structured_output
    if spec is None:
        return None
    validate(spec, field=f"sampling.structured_output.{spec.kind}")
    return spec


def _from_response_format(request: ChatRequest) -> StructuredOutputSpec | None:
    response_format = request.response_format
    kind = response_format.type
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidArgument(f"response_format.type {kind!r} is not supported; use text, json_object or json_schema",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.type")
    if kind != "json_schema" and response_format.json_schema is not None:
        raise InvalidArgument(f"response_format.json_schema needs type json_schema (got {kind or 'text'!r})",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.json_schema")
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind != "json_schema":
        return None
    if response_format.json_schema is None or response_format.json_schema.schema is None:
        raise InvalidArgument("response_format type json_schema needs json_schema.schema (a JSON Schema object)",
                              reason=INVALID_RESPONSE_FORMAT, field="response_format.json_schema.schema")
    from tito_render.messages import request_struct

    field = "response_format.json_schema.schema"
    schema = json.dumps(request_struct(response_format.json_schema.schema, field))
    spec = StructuredOutputSpec("json_schema", schema)
    validate(spec, field=field)
    return spec


def _tool_calls(tools: list[dict[str, Any]], markup: ToolMarkup, names: list[str] | None, field: str,
                parallel: bool, triggered: bool = False,
                reasoning: ReasoningStart | None = None) -> StructuredOutputSpec:
    """A structural tag: calls of the named tool (or of any tool), or with `triggered`, free
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
        tags.append(markup.call(function["name"], schema))
    structural_tag = json.dumps({"type": "structural_tag", "format": _reasoning_then(
        reasoning, calls_format(markup, tags, parallel, triggered))})
    tag = StructuredOutputSpec("structural_tag", structural_tag)
    validate(tag, field=field)
    if markup.xml_arguments:
        grammar = StructuredOutputSpec("grammar", xml_grammar(structural_tag, markup.bare_values))
        validate(grammar, field=field)
        return grammar
    return tag
