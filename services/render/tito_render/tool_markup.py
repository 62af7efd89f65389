"""Tool calls in each model family's own markup, as xgrammar structural-tag formats.

One `ToolMarkup` per markup tito's derender parses (the parser names of DerenderContext, plus the
variants of one parser that write calls differently: `markup_variant`). A call is a `tag`: the
text before the arguments (with the function name), the arguments, the text after. The arguments
are a JSON-schema format: JSON for most families, xgrammar's `qwen_xml` style for Qwen3-Coder
(`<parameter=k>v</parameter>`) and its `glm_xml` style for GLM-4.5 (`<arg_key>k</arg_key><arg_value>
v</arg_value>`), so XML-ish arguments are typed by the tool's schema too.

Markers that are special tokens (Kimi's, GLM's, harmony's; Mistral's `[TOOL_CALLS]`) are matched
by their text: xgrammar keeps added tokens in its vocabulary with their text, so the marker's one
token is an allowed spelling (the one a trained model writes); so are the pieces of its text,
which decode to the same string, the one derender's parser reads.

What each family constrains (tool_choice required / named function; strict tools under auto):

| markup        | required / named                               | auto + strict tools          |
| ------------- | ---------------------------------------------- | ---------------------------- |
| hermes        | calls, "\\n" between                            | after `<tool_call>`          |
| llama3_json   | calls, "; " between                            | not constrained (calls only  |
|               |                                                | at the start of the output)  |
| mistral       | `[TOOL_CALLS]name{args}` per call (v11+)       | after `[TOOL_CALLS]`         |
| mistral_v13   | `[TOOL_CALLS]name[ARGS]{args}` per call        | after `[TOOL_CALLS]`         |
| mistral_list  | `[TOOL_CALLS][{"name", "arguments"}, ...]`     | after `[TOOL_CALLS]`         |
| qwen3_coder   | `<tool_call>\\n<function=name>\\n` XML params   | after `<tool_call>`          |
| deepseek_v3   | calls section, fenced JSON (V3 / R1)           | after the section marker     |
| deepseek_v31  | calls section, bare JSON (V3.1)                | after the section marker     |
| kimi_k2       | calls section, `functions.name:N` ids          | after the section marker     |
| glm45         | `<tool_call>name\\n` arg_key / arg_value pairs  | after `<tool_call>`          |
| gpt_oss       | one commentary message to=functions.name       | not constrained              |
| pythonic      | not constrained (Python call syntax)           | not constrained              |

gpt_oss: a harmony call ends with `<|call|>`, a stop token, so a turn holds one call (no parallel
calls); the grammar ends after the arguments and the stop token ends the turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

# Bounded whitespace inside a tool call's JSON: a model cannot pad a call forever.
CALL_JSON_MAX_WHITESPACE = 1

Format = dict[str, Any]


def json_arguments(schema: Any, style: str = "json") -> Format:
    """A call's arguments under `schema`, as JSON or in one of xgrammar's XML styles."""
    return {"type": "json_schema", "json_schema": schema, "style": style,
            "max_whitespace_cnt": CALL_JSON_MAX_WHITESPACE}


@dataclass(frozen=True)
class ToolMarkup:
    """How one family writes tool calls."""

    #: The tag of one call: (function name, arguments schema) -> tag format.
    call: Callable[[str, Any], Format]
    #: Between two calls.
    separator: str = ""
    #: Around all the calls of a turn ("" when each call stands alone).
    section: tuple[str, str] = ("", "")
    #: The text that opens any call in free text (None: no constraint under tool_choice auto).
    trigger: str | None = None
    #: Whether a turn can hold more than one call.
    parallel: bool = True
    #: XML-ish arguments: sent as an EBNF grammar whose optional whitespace is one newline
    #: (xml_grammar), so values carry no whitespace the family's parser would keep.
    xml_arguments: bool = False
    #: The markers around an XML value that takes no whitespace at all (GLM's parser keeps it).
    bare_values: tuple[str, str] | None = None


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _kimi_call(name: str, schema: Any) -> Format:
    # The id is functions.NAME:N (N counts the conversation's calls): any number.
    return _tag(f"<|tool_call_begin|>functions.{name}:",
                {"type": "sequence", "elements": [{"type": "regex", "pattern": "[0-9]{1,6}"},
                                                  {"type": "const_string", "value": "<|tool_call_argument_begin|>"},
                                                  json_arguments(schema)]},
                "<|tool_call_end|>")


def _harmony_call(name: str, schema: Any) -> Format:
    return _tag(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", json_arguments(schema), "")


MARKUPS: dict[str, ToolMarkup] = {
    # <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call> (Qwen's chat templates)
    "hermes": ToolMarkup(
        call=lambda name, schema: _tag('<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
                                       json_arguments(schema), "}\n</tool_call>"),
        separator="\n", trigger="<tool_call>"),
    "llama3_json": ToolMarkup(
        call=lambda name, schema: _tag('{"name": ' + json.dumps(name) + ', "parameters": ',
                                       json_arguments(schema), "}"),
        separator="; "),
    "mistral": ToolMarkup(call=lambda name, schema: _tag(f"[TOOL_CALLS]{name}", json_arguments(schema), ""),
                          trigger="[TOOL_CALLS]"),
    "mistral_v13": ToolMarkup(call=lambda name, schema: _tag(f"[TOOL_CALLS]{name}[ARGS]", json_arguments(schema), ""),
                              trigger="[TOOL_CALLS]"),
    "mistral_list": ToolMarkup(
        call=lambda name, schema: _tag('{"name": ' + json.dumps(name) + ', "arguments": ',
                                       json_arguments(schema), "}"),
        separator=", ", section=("[TOOL_CALLS][", "]"), trigger="[TOOL_CALLS]"),
    "qwen3_coder": ToolMarkup(
        call=lambda name, schema: _tag(f"<tool_call>\n<function={name}>\n", json_arguments(schema, "qwen_xml"),
                                       "\n</function>\n</tool_call>"),
        separator="\n", trigger="<tool_call>", xml_arguments=True),
    "deepseek_v3": ToolMarkup(
        call=lambda name, schema: _tag(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                                       json_arguments(schema), "\n```<｜tool▁call▁end｜>"),
        separator="\n", section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), trigger="<｜tool▁calls▁begin｜>"),
    "deepseek_v31": ToolMarkup(
        call=lambda name, schema: _tag(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", json_arguments(schema),
                                       "<｜tool▁call▁end｜>"),
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), trigger="<｜tool▁calls▁begin｜>"),
    "kimi_k2": ToolMarkup(call=_kimi_call, section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
                          trigger="<|tool_calls_section_begin|>"),
    "glm45": ToolMarkup(
        call=lambda name, schema: _tag(f"<tool_call>{name}\n", json_arguments(schema, "glm_xml"), "</tool_call>"),
        separator="\n", trigger="<tool_call>", xml_arguments=True,
        bare_values=("<arg_value>", "</arg_value>")),
    "gpt_oss": ToolMarkup(call=_harmony_call, parallel=False),
}


def markup_variant(tool_parser: str, vocab: Any, template: str) -> str:
    """The MARKUPS key for a model: the parser's name, or the variant its template writes
    (Mistral: `[ARGS]` in the template, or in a vocabulary without a template -> v13; a JSON list
    after the marker, or no marker in the template -> the pre-v11 list; else v11. DeepSeek: a
    `thinking` switch in the template -> V3.1, as families.py decides)."""
    if tool_parser == "mistral":
        if "[ARGS]" in template or ("[ARGS]" in vocab and not template):
            return "mistral_v13"
        if "[TOOL_CALLS]" not in template or any(f"[TOOL_CALLS]{gap}[" in template for gap in ("", " ")):
            return "mistral_list"
        return "mistral"
    if tool_parser == "deepseek_v3" and "thinking" in template:
        return "deepseek_v31"
    return tool_parser


def calls_format(markup: ToolMarkup, tags: list[Format], parallel: bool, triggered: bool) -> Format:
    """One or more calls (one when not `parallel`); with `triggered`, free text in which whatever
    follows the trigger is well-formed calls."""
    several = parallel and markup.parallel
    begin, end = markup.section
    if triggered:
        if begin:
            section = _tag(begin, {"type": "tags_with_separator", "tags": tags, "separator": markup.separator,
                                   "at_least_one": True, "stop_after_first": not several}, end)
            return {"type": "triggered_tags", "triggers": [markup.trigger], "tags": [section],
                    "stop_after_first": not several}
        return {"type": "triggered_tags", "triggers": [markup.trigger], "tags": tags, "stop_after_first": not several}
    if several:
        calls: Format = {"type": "tags_with_separator", "tags": tags, "separator": markup.separator,
                         "at_least_one": True}
    else:
        calls = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if begin:
        return {"type": "sequence", "elements": [{"type": "const_string", "value": begin}, calls,
                                                 {"type": "const_string", "value": end}]}
    return calls


# xgrammar's optional whitespace (between XML parameters, around a value): any one of space, tab,
# CR, LF. The families' parsers strip exactly the newline their templates write around a value
# and keep any other whitespace as part of it (vLLM's do the same), so a `\r` or a space there
# would change a value the grammar had checked (an enum "f" read as "\rf").
_ANY_WHITESPACE = "[ \\n\\r\\t]"
_NEWLINE = "[\\n]"


def xml_grammar(structural_tag: str, bare_values: tuple[str, str] | None = None) -> str:
    """The EBNF of a structural tag with XML-ish arguments, its optional whitespace one newline
    (none at all next to the `bare_values` markers)."""
    from tito.structured_output import StructuredOutputSpec, grammar_of

    ebnf = str(grammar_of(StructuredOutputSpec("structural_tag", structural_tag)))
    if bare_values is not None:
        opening, closing = (json.dumps(marker) for marker in bare_values)
        bare = set(re.findall(re.escape(opening) + r" (\w+)", ebnf)) | set(
            re.findall(r"(\w+) " + re.escape(closing), ebnf))
        for rule in bare:
            ebnf = ebnf.replace(f'{rule} ::= ("" | ({_ANY_WHITESPACE}))', f'{rule} ::= ("")')
    return ebnf.replace(_ANY_WHITESPACE, _NEWLINE)
