"""The harness of the parser-fidelity tables (tests/unit/derender/test_derender_parser_fidelity.py).

A case is a model output, the request's tools, parsers and tool_choice, and what derender must
make of it. `check_case` parses it every way derender can meet it, and asserts each equals the
non-streamed parse, which must equal the expected result:

- whole: `DerenderStream(streaming=False)` fed all token ids in one engine message;
- one token id per engine message, streamed;
- random groups of token ids per engine message, streamed;
- the text in random character pieces through the choice's stages, streamed.

A case whose streamed parse differs from the whole one by design (a call broken after its name
went out) names the streamed calls (`streamed_calls`).

Tokenizers: the family's own (its markers are single tokens) where the parser has one, else
Qwen3's (byte-level BPE: any text round-trips).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from tito_derender.detokenizer import TextOptions
from tito_derender.domain import EngineOutput, FinishReason, OutputDelta, RequestContext, ToolCallDelta, ToolChoiceMode
from tito_derender.parsers import reasoning_parser_for, tool_stage_for
from tito_derender.stream import DerenderStream
from hf_reference import hf_of
from parser_streams import merge, random_pieces

#: tool parser -> the family tokenizer its cases are encoded with.
FAMILY_OF_PARSER = {"qwen3_coder": "qwen3_coder", "hermes": "qwen3_coder", "llama3_json": "qwen3_coder",
                    "pythonic": "qwen3_coder", "mistral": "qwen3_coder", "deepseek_v3": "deepseek_v31",
                    "kimi_k2": "kimi_k2", "glm45": "glm45", "gpt_oss": "gpt_oss"}


@dataclass(frozen=True)
class Case:
    """One output and what derender must make of it."""

    parser: str
    text: str
    tools: dict[str, dict]
    content: str
    calls: list[tuple[str, dict]]
    reasoning: str = ""
    reasoning_parser: str = ""
    prompt_opens_reasoning: bool = False
    tool_choice: str = ""  # "" auto, else the one function a named tool_choice accepts
    finish: FinishReason = FinishReason.STOP
    #: The model's own call ids (kimi_k2), when the case checks them.
    ids: list[str] | None = None
    #: The calls a streamed parse makes, where they differ from the whole parse's: a call that
    #: breaks after its name went out has its arguments closed (whole, it is content).
    streamed_calls: list[tuple[str, dict]] | None = None
    label: str = field(default="", compare=False)

    def context(self) -> RequestContext:
        return RequestContext(
            tool_parser=self.parser, reasoning_parser=self.reasoning_parser,
            thinking_enabled=bool(self.reasoning_parser), prompt_opens_reasoning=self.prompt_opens_reasoning,
            tool_names=tuple(self.tools),
            tool_choice=ToolChoiceMode.NAMED if self.tool_choice else ToolChoiceMode.AUTO,
            tool_choice_function=self.tool_choice,
            tool_schemas=tuple(self.tools.items()), text=TextOptions(skip_special_tokens=False))


def case_id(case: Case) -> str:
    return f"{case.parser}-{case.label}" if case.label else case.parser


def _result(content: str, reasoning: str, deltas: list[ToolCallDelta]):
    calls = merge(deltas)
    return content, reasoning, [(name, arguments) for _, name, arguments in calls], [i for i, _, _ in calls]


def run_ids(tokenizer, context: RequestContext, groups: list[list[int]], finish: FinishReason, streaming: bool):
    stream = DerenderStream(tokenizer, context, streaming=streaming)
    chunks = []
    for group in groups:
        chunks += stream.feed(EngineOutput(index=0, token_ids=tuple(group)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=finish))
    return _result("".join(c.content for c in chunks), "".join(c.reasoning_content for c in chunks),
                   [d for c in chunks for d in c.tool_calls])


def run_text(context: RequestContext, pieces: list[str], streaming: bool = True):
    """The choice's parser stages alone (no detokenizer), fed `pieces` of text."""
    tools = tool_stage_for(context, streaming)
    reasoning = reasoning_parser_for(context, tools)
    stages = [stage for stage in (reasoning, tools) if stage is not None]
    content, thought, deltas = "", "", []
    for index, piece in enumerate(pieces + [""]):
        delta = OutputDelta(content=piece)
        for stage in stages:
            delta = stage.process(delta, final=index == len(pieces))
        content, thought, deltas = content + delta.content, thought + delta.reasoning_content, deltas + delta.tool_calls
    return _result(content, thought, deltas)


def check_case(case: Case, tokenizers: dict) -> None:
    tokenizer = tokenizers[FAMILY_OF_PARSER[case.parser]]
    ids = hf_of(tokenizer).encode(case.text, add_special_tokens=False)
    assert hf_of(tokenizer).decode(ids, skip_special_tokens=False) == case.text  # the text round-trips
    context = case.context()
    whole = run_ids(tokenizer, context, [ids], case.finish, streaming=False)
    content, reasoning, calls, call_ids = whole
    assert (content, reasoning) == (case.content, case.reasoning), whole
    assert [(name, json.loads(arguments)) for name, arguments in calls] == case.calls, whole
    if case.ids is not None:
        assert call_ids == case.ids
    rng = random.Random(len(case.text))
    runs = {"one id per message": run_ids(tokenizer, context, [[i] for i in ids], case.finish, True)}
    for attempt in range(3):
        runs[f"id groups {attempt}"] = run_ids(tokenizer, context, random_pieces(ids, rng, 4), case.finish, True)
    runs["characters"] = run_text(context, list(case.text))
    for attempt in range(3):
        runs[f"text pieces {attempt}"] = run_text(context, ["".join(p) for p in random_pieces(list(case.text), rng, 9)])
    for how, got in runs.items():
        if case.streamed_calls is None:
            assert got[:3] == whole[:3], (how, got, whole)
        else:  # what the broken call's text leaves as content depends on where the pieces split
            assert [(name, json.loads(arguments)) for name, arguments in got[2]] == case.streamed_calls, (how, got)
        if case.ids is not None:
            assert got[3] == case.ids, how
