"""Output parsers by the names a DerenderContext uses (declared once, in tito.parsers).

Render names the parsers (from the model) in the DerenderContext; derender builds one instance
per choice. A tool format's parser is the `PARSER` class of the module named as the format
(`tools/<name>.py`). An unknown name is the caller's mistake (INVALID_ARGUMENT naming the field
and the known names), checked before any engine output is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Callable
from importlib import import_module

from tito.errors import InvalidArgument, quoted
from tito.parsers import (REASONING_PARSER_NAMES, SCHEMA_READING_TOOL_PARSERS, STRUCTURAL_REASONING_PARSERS,
                          TOOL_PARSER_NAMES, TOOL_PARSERS_NEEDING_SPECIAL_TOKENS)
from tito_derender.domain import RequestContext, ToolChoiceMode
from tito_derender.parsers.harmony import HarmonyReasoningParser
from tito_derender.parsers.reasoning import ThinkReasoningParser
from tito_derender.parsers.tool_stage import ToolStage
from tito_derender.parsers.tools.base import ToolParser
from tito_derender.parsers.tools.markup import MarkupToolParser

#: name -> factory(prompt_opens_reasoning, call_markers) for the reasoning parsers; call_markers:
#: the tool parser's (start, end) when tool calls are parsed (a call may end the reasoning).
_REASONING_FACTORIES: dict[str, Callable[[bool, tuple[str, str] | None],
                                         ThinkReasoningParser | HarmonyReasoningParser]] = {
    "qwen3": lambda prompt_opens, calls: ThinkReasoningParser(start_in_reasoning=prompt_opens, call_markers=calls),
    "deepseek_r1": lambda prompt_opens, calls: ThinkReasoningParser(start_in_reasoning=True, call_markers=calls),
    "gpt_oss": lambda prompt_opens, calls: HarmonyReasoningParser(),
}
#: The reasoning formats of tito.parsers, by name.
REASONING_PARSERS = {name: _REASONING_FACTORIES[name] for name in REASONING_PARSER_NAMES}


def _tool_parser_class(name: str) -> type[ToolParser]:
    """A tool format's parser: `PARSER` of the module `tito_derender.parsers.tools.<name>`."""
    parser = import_module(f"{__name__}.tools.{name}").PARSER
    if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
        raise TypeError(f"tito_derender.parsers.tools.{name}.PARSER is not a ToolParser")
    return parser


#: The tool-call formats of tito.parsers, by name -> ToolParser class.
TOOL_PARSERS: dict[str, type[ToolParser]] = {name: _tool_parser_class(name) for name in TOOL_PARSER_NAMES}
__all__ = ["REASONING_PARSERS", "SCHEMA_READING_TOOL_PARSERS", "STRUCTURAL_REASONING_PARSERS", "TOOL_PARSERS",
           "needs_special_tokens", "reasoning_parser_for", "tool_stage_for", "validate_parser_names"]


def validate_parser_names(context: RequestContext) -> None:
    for field, name, known in (("context.reasoning_parser", context.reasoning_parser, REASONING_PARSERS),
                               ("context.tool_parser", context.tool_parser, TOOL_PARSERS)):
        if name and name not in known:
            raise InvalidArgument(
                f"unknown {field.split('.')[1].replace('_', ' ')} {quoted(name)}: known ones are "
                f"{', '.join(sorted(known))} (or empty for none)", reason="UNKNOWN_PARSER", field=field)


def reasoning_parser_for(context: RequestContext, tools: ToolStage | None = None
                         ) -> ThinkReasoningParser | HarmonyReasoningParser | None:
    """None when the request has no reasoning parser or thinking is off (then all is content),
    except for a structural parser (STRUCTURAL_REASONING_PARSERS), which always runs.
    `tools`: the choice's tool stage, whose parser's calls may end the reasoning."""
    if not context.reasoning_parser:
        return None
    if not context.thinking_enabled and context.reasoning_parser not in STRUCTURAL_REASONING_PARSERS:
        return None
    markers = type(tools.parser).call_markers if tools is not None else None
    return REASONING_PARSERS[context.reasoning_parser](context.prompt_opens_reasoning, markers)


def needs_special_tokens(tool_parser: str) -> bool:
    """Whether the named tool parser reads special tokens (render's default skip_special_tokens
    is false for the requests it parses; both read tito.parsers)."""
    return tool_parser in TOOL_PARSERS_NEEDING_SPECIAL_TOKENS


@dataclass(frozen=True)
class AcceptName:
    """Which calls a tool parser takes: those to `named`, or any when None. A class, not a
    closure, so a stream's state can be sealed and resumed (tito_derender.resume)."""

    named: str | None = None

    def __call__(self, name: str) -> bool:
        return self.named is None or name == self.named


def tool_stage_for(context: RequestContext, streaming: bool = True) -> ToolStage | None:
    """None when tool calls are not parsed: no parser, no tools, or tool_choice none (markup then
    stays content). "required" parses like "auto" (derender cannot make the model call; the
    engine's constraints must); a named function parses only calls to that function."""
    if not context.tool_parser or not context.tool_names or context.tool_choice == ToolChoiceMode.NONE:
        return None
    accept = AcceptName(context.tool_choice_function if context.tool_choice == ToolChoiceMode.NAMED else None)
    parser_class = TOOL_PARSERS[context.tool_parser]
    options = {"streaming": streaming, "accept_name": accept, "tool_names": context.tool_names}
    if issubclass(parser_class, MarkupToolParser):
        options["tools"] = dict(context.tool_schemas)
    return ToolStage(parser_class(**options))
