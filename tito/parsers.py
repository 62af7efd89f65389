"""The output formats tito parses, declared once: the names render puts in a DerenderContext
(`reasoning_parser`, `tool_parser`) and everything both services must agree on about each.

Render reads it to offer the names (`--tool-parser` / `--reasoning-parser` choices), to detect a
model's format (`auto`), to keep special tokens in the text when the format's markers are special
tokens, and to send the tools' schemas where values are typed by them. Derender reads it to know
the names (an unknown one is UNKNOWN_PARSER) and finds each tool format's parser by its name:
the module `tito_derender.parsers.tools.<name>`, whose `PARSER` is the class.

The `tito` command reads each format's SMG name (`smg`) to start SMG in front of `tito serve all`
with the parsers tito would use (`--smg-address`).

Adding a tool-call format: one `ToolFormat` entry here, and one parser module in derender (named
as the format, with `PARSER = TheClass`). A test checks that every entry has its module and that
render and derender offer exactly these names. (To constrain calls of the format under
tool_choice required / named, render's `tool_markup.MARKUPS` takes an entry too; without one,
calls in it are parsed but not constrained.)

Plain data, no imports beyond the standard library: both services and the client read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

THINK = ("<think>", "</think>")
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>")


@dataclass(frozen=True)
class Detection:
    """How render's `auto` recognises a format: every one of `vocabulary` is a token of the
    model's vocabulary and every one of `template` is in its chat template."""

    vocabulary: tuple[str, ...]
    template: tuple[str, ...] = ()

    def matches(self, vocab: Mapping[str, int] | set[str], template: str) -> bool:
        return all(token in vocab for token in self.vocabulary) and all(text in template for text in self.template)


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format (a `DerenderContext.tool_parser` name)."""

    name: str
    #: The model families that write it (documentation).
    family: str
    #: The marker texts derender's parser reads: when one is a special token of the model's
    #: tokenizer, render keeps special tokens in the output text for requests it parses.
    markers: tuple[str, ...] = ()
    #: How render's `auto` detects it; None: only when named explicitly. Formats are tried in
    #: TOOL_FORMATS order, so one whose detection is a subset of another's comes after it.
    detection: Detection | None = None
    #: Its markup is special tokens the tokenizer may not flag as the model's own (Mistral's
    #: `[TOOL_CALLS]`): render keeps special tokens whenever it parses tool calls.
    needs_special_tokens: bool = False
    #: Its parser reads the tools' JSON schemas (argument values written as text are typed by
    #: them; a Kimi-K2 call whose id names no function is matched to a tool by its arguments):
    #: derender takes the schemas from the context's tools.
    reads_schemas: bool = False
    #: SMG's `--tool-call-parser` for the same format ("": SMG has none by that flag and picks its
    #: own), so SMG in front of `tito serve all` parses calls as tito's derender does.
    smg: str = ""


@dataclass(frozen=True)
class ReasoningFormat:
    """One reasoning format (a `DerenderContext.reasoning_parser` name)."""

    name: str
    family: str
    markers: tuple[str, ...] = ()
    #: It also takes the output's message structure apart (harmony headers and channels), so it
    #: runs whether or not thinking is on.
    structural: bool = False
    #: SMG's `--reasoning-parser` for the same format ("": SMG picks its own).
    smg: str = ""
    #: SMG's Symphony table (`--parser symphony`) that splits the output exactly as tito does,
    #: where SMG's legacy parser (`smg`) does not; used only where tito parses no tool calls: SMG
    #: refuses a Symphony reasoning table beside a legacy tool-call parser, and the table's own
    #: tool-call reading is not tito's hermes (it drops `<tool_call>` tags and parses no call).
    smg_symphony: str = ""


_TOOL_FORMATS = (
    ToolFormat("kimi_k2", "Kimi-K2",
               ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
               Detection(("<|tool_calls_section_begin|>",)), reads_schemas=True, smg="kimik2"),
    ToolFormat("deepseek_v3", "DeepSeek-V3 / R1 / V3.1",
               ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁sep｜>"),
               Detection(("<｜tool▁calls▁begin｜>",)), smg="deepseek"),
    # SMG reads harmony in its own gpt-oss pipeline, not through a named parser.
    ToolFormat("gpt_oss", "gpt-oss (harmony)", HARMONY, Detection(("<|channel|>", "<|message|>"))),
    ToolFormat("glm45", "GLM-4.5",
               ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
               Detection(("<arg_key>",)), reads_schemas=True, smg="glm45_moe"),
    ToolFormat("qwen3_coder", "Qwen3-Coder", ("<tool_call>", "</tool_call>"),
               Detection(("<tool_call>",), ("<function=",)), reads_schemas=True, smg="qwen_coder"),
    ToolFormat("hermes", "Hermes, Qwen2.5 / Qwen3", ("<tool_call>", "</tool_call>"), Detection(("<tool_call>",)),
               smg="qwen"),
    ToolFormat("llama3_json", "Llama 3.x", smg="llama"),
    # [TOOL_CALLS] is kept per request, for requests with tools (needs_special_tokens), not per model
    ToolFormat("mistral", "Mistral", needs_special_tokens=True, smg="mistral"),
    ToolFormat("pythonic", "Llama 3.2 / 4 pythonic", smg="pythonic"),
)

_REASONING_FORMATS = (
    # SMG 1.13's legacy `qwen3` files an answer without a `<think>` block as reasoning (unless the
    # request turns thinking off); its Symphony table `qwen3_tagged` makes it content, as tito does.
    ReasoningFormat("qwen3", "Qwen3, GLM-4.5, DeepSeek-V3.1", THINK, smg="qwen3", smg_symphony="qwen3_tagged"),
    ReasoningFormat("deepseek_r1", "DeepSeek-R1", THINK, smg="deepseek_r1"),
    ReasoningFormat("gpt_oss", "gpt-oss (harmony)", HARMONY, structural=True),
)

#: Tool-call formats by name, in detection order.
TOOL_FORMATS: Mapping[str, ToolFormat] = MappingProxyType({f.name: f for f in _TOOL_FORMATS})
#: Reasoning formats by name.
REASONING_FORMATS: Mapping[str, ReasoningFormat] = MappingProxyType({f.name: f for f in _REASONING_FORMATS})

TOOL_PARSER_NAMES: tuple[str, ...] = tuple(TOOL_FORMATS)
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(REASONING_FORMATS)
#: Tool formats whose markup needs special tokens kept whatever the tokenizer flags.
TOOL_PARSERS_NEEDING_SPECIAL_TOKENS = frozenset(f.name for f in _TOOL_FORMATS if f.needs_special_tokens)
#: Tool formats whose parsers read the tools' schemas.
SCHEMA_READING_TOOL_PARSERS = frozenset(f.name for f in _TOOL_FORMATS if f.reads_schemas)
#: Reasoning formats that run whether or not thinking is on.
STRUCTURAL_REASONING_PARSERS = frozenset(f.name for f in _REASONING_FORMATS if f.structural)


def detect_tool_format(vocab: Mapping[str, int] | set[str], template: str) -> str:
    """The first tool format whose detection matches the model, "" when none does."""
    return next((f.name for f in _TOOL_FORMATS if f.detection and f.detection.matches(vocab, template)), "")


def markers_of(*names: str) -> frozenset[str]:
    """The markers the named formats read (tool or reasoning names; unknown names have none)."""
    found: set[str] = set()
    for name in names:
        for table in (TOOL_FORMATS, REASONING_FORMATS):
            entry = table.get(name)
            if entry is not None:
                found.update(entry.markers)
    return frozenset(found)
