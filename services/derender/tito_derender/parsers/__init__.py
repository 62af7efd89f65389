"""Output parsers and their registry by the names a DerenderContext uses.

Render names the parsers (from the model) in the DerenderContext; derender builds one instance
per choice. An unknown name is the caller's mistake (INVALID_ARGUMENT naming the field and the
known names), checked before any engine output is read.
"""

from __future__ import annotations

from collections.abc import Callable

from tito.errors import InvalidArgument, quoted
from tito_derender.domain import RequestContext, ToolChoiceMode
from tito_derender.parsers.harmony import HarmonyReasoningParser
from tito_derender.parsers.reasoning import ThinkReasoningParser
from tito_derender.parsers.tool_stage import ToolStage
from tito_derender.parsers.tools.base import ToolParser
from tito_derender.parsers.tools.deepseek_v3 import DeepSeekV3ToolParser
from tito_derender.parsers.tools.glm45 import Glm45ToolParser
from tito_derender.parsers.tools.gpt_oss import GptOssToolParser
from tito_derender.parsers.tools.hermes import HermesToolParser
from tito_derender.parsers.tools.kimi_k2 import KimiK2ToolParser
from tito_derender.parsers.tools.llama3_json import Llama3JsonToolParser
from tito_derender.parsers.tools.markup import MarkupToolParser
from tito_derender.parsers.tools.mistral import MistralToolParser
from tito_derender.parsers.tools.pythonic import PythonicToolParser
from tito_derender.parsers.tools.qwen3_coder import Qwen3CoderToolParser

#: name -> factory(prompt_opens_reasoning, call_markers) for the reasoning parsers; call_markers:
#: the tool parser's (start, end) when tool calls are parsed (a call may end the reasoning).
REASONING_PARSERS: dict[str, Callable[[bool, tuple[str, str] | None], ThinkReasoningParser | HarmonyReasoningParser]] = {
    "qwen3": lambda prompt_opens, calls: ThinkReasoningParser(start_in_reasoning=prompt_opens, call_markers=calls),
    "deepseek_r1": lambda prompt_opens, calls: ThinkReasoningParser(start_in_reasoning=True, call_markers=calls),
    "gpt_oss": lambda prompt_opens, calls: HarmonyReasoningParser(),
}

#: name -> ToolParser class.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "gpt_oss": GptOssToolParser,
}
#: Tool parsers that type argument values by the tools' JSON schemas (they get the schemas).
SCHEMA_TYPED_TOOL_PARSERS = frozenset({"qwen3_coder", "glm45"})


def validate_parser_names(context: RequestContext) -> None:
    for field, name, known in (("context.reasoning_parser", context.reasoning_parser, REASONING_PARSERS),
                               ("context.tool_parser", context.tool_parser, TOOL_PARSERS)):
        if name and name not in known:
            raise InvalidArgument(
                f"unknown {field.split('.')[1].replace('_', ' ')} {quoted(name)}: known ones are "
                f"{', '.join(sorted(known))} (or empty for none)", reason="UNKNOWN_PARSER", field=field)


#: Reasoning parsers that also take the output's message structure apart (harmony headers and
#: channels): they run whether or not thinking is on, since the model writes that structure anyway.
STRUCTURAL_REASONING_PARSERS = frozenset({"gpt_oss"})


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
    is false for the requests it parses; tito_render.config lists the same names)."""
    parser = TOOL_PARSERS.get(tool_parser)
    return parser is not None and parser.needs_special_tokens


def tool_stage_for(context: RequestContext, streaming: bool = True) -> ToolStage | None:
    """None when tool calls are not parsed: no parser, no tools, or tool_choice none (markup then
    stays content). "required" parses like "auto" (derender cannot make the model call; the
    engine's constraints must); a named function parses only calls to that function."""
    if not context.tool_parser or not context.tool_names or context.tool_choice == ToolChoiceMode.NONE:
        return None
    if context.tool_choice == ToolChoiceMode.NAMED:
        named = context.tool_choice_function
        accept = lambda name: name == named  # noqa: E731
    else:
        accept = lambda name: True  # noqa: E731
    parser_class = TOOL_PARSERS[context.tool_parser]
    options = {"streaming": streaming, "accept_name": accept, "tool_names": context.tool_names}
    if issubclass(parser_class, MarkupToolParser):
        options["tools"] = dict(context.tool_schemas)
    return ToolStage(parser_class(**options))
