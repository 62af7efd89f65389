"""Tool-call and reasoning parsers of the model families with their own markup (qwen3_coder,
deepseek_v3, kimi_k2, glm45, gpt_oss): table tests of well-formed, parallel, content around
calls, malformed and truncated outputs, each streamed under several chunkings (all at once, one
character at a time, random pieces) and equal to the complete (non-streamed) parse."""

from __future__ import annotations

import json

import pytest

from tito_derender.domain import OutputDelta, ToolCallDelta
from tito_derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from tito_derender.parsers.tool_stage import ToolStage
from tito_derender.parsers.tools.markup import typed_value

from markup_calls import coder, glm
from parser_streams import chunkings, merge

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}
W = {"city": "Paris", "days": 3, "nested": {"ok": True, "none": None}, "q": "a\"b é"}
W_JSON = json.dumps(W, ensure_ascii=False)

# DeepSeek markers
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# Kimi markers
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def ds_v3(name, arguments):
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def ds_v31(name, arguments):
    return f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}"


def kimi(name, index, arguments):
    return f"{K_CALL}functions.{name}:{index}{K_ARGS}{arguments}{K_CALL_END}"


# (tool parser, text, content, [(name, arguments)])
CASES = [
    # -- qwen3_coder
    ("qwen3_coder", coder("get_weather", city="Paris", days=3, metric="True", ratio="0.5"), "",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5})]),
    ("qwen3_coder", "Let me check.\n\n" + coder("get_weather", city="New\nYork", options='{"a": [1, 2]}') + "\n"
     + coder("search", query="  spaced  ", unknown="7"), "Let me check.",
     [("get_weather", {"city": "New\nYork", "options": {"a": [1, 2]}}), ("search", {"query": "  spaced  ",
                                                                                  "unknown": "7"})]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>\n</tool_call> after", " after",
     [("search", {})]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\nx < y\n<parameter=unknown>\nz\n</function>\n"
                    "</tool_call>", "", [("search", {"query": "x < y", "unknown": "z"})]),  # </parameter> dropped
    ("qwen3_coder", "a <tool_ b <function c <function= d", "a <tool_ b <function c <function= d", []),
    # `<function=` alone opens a call too (a model that drops `<tool_call>`)
    ("qwen3_coder", "Sure.\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function> after", "Sure. after",
     [("search", {"query": "x"})]),
    # -- deepseek_v3 (both forms)
    ("deepseek_v3", DS_BEGIN + ds_v3("get_weather", W_JSON) + DS_END, "", [("get_weather", W)]),
    ("deepseek_v3", "Checking." + DS_BEGIN + ds_v3("get_weather", '{"city": "Oslo"}') + "\n"
     + ds_v3("search", "{}") + DS_END + " done", "Checking. done",
     [("get_weather", {"city": "Oslo"}), ("search", {})]),
    ("deepseek_v3", DS_BEGIN + ds_v31("get_weather", W_JSON) + ds_v31("search", '{"query": "x"}') + DS_END, "",
     [("get_weather", W), ("search", {"query": "x"})]),
    ("deepseek_v3", "no calls <｜tool▁calls here", "no calls <｜tool▁calls here", []),
    # -- kimi_k2
    ("kimi_k2", K_BEGIN + kimi("get_weather", 0, W_JSON) + K_END, "", [("get_weather", W)]),
    ("kimi_k2", "Sure. " + K_BEGIN + kimi("get_weather", 0, '{"city": "Oslo"}') + kimi("search", 1, "{}") + K_END
     + " after", "Sure. after", [("get_weather", {"city": "Oslo"}), ("search", {})]),
    ("kimi_k2", "text <|tool_calls_section", "text <|tool_calls_section", []),
    ("kimi_k2", "Let me help you with that.\n" + K_BEGIN + "\n" + K_CALL + "\nfunctions.get_weather:0" + K_ARGS
     + '\n{"city": "Tokyo"}\n' + K_CALL_END + "\n" + K_END + "\nThe weather in Tokyo is...",
     "Let me help you with that.\nThe weather in Tokyo is...", [("get_weather", {"city": "Tokyo"})]),
    # -- glm45
    ("glm45", glm("get_weather", city="Paris", days="3", options='{"k": [1]}'), "",
     [("get_weather", {"city": "Paris", "days": 3, "options": {"k": [1]}})]),
    ("glm45", "I will look.\n" + glm("get_weather", city="42") + "\n" + glm("search", query="q", extra="[1, 2]",
                                                                          free="not json") + "\nbye",
     "I will look.\nbye", [("get_weather", {"city": "42"}), ("search", {"query": "q", "extra": [1, 2],
                                                                        "free": "not json"})]),
    ("glm45", "<tool_call>search\n</tool_call>", "", [("search", {})]),
    ("glm45", "<tool_call>search</tool_call>", "", [("search", {})]),
    ("glm45", "use <tool_ and <arg_key> here", "use <tool_ and <arg_key> here", []),
    # -- gpt_oss (tool stage only: the messages as the harmony stage passes them on)
    ("gpt_oss", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' + W_JSON + "<|call|>",
     "", [("get_weather", W)]),
    ("gpt_oss", 'Let me look.<|start|>assistant to=functions.search<|channel|>commentary json<|message|>'
                '{"query": "x"}<|call|>', "Let me look.", [("search", {"query": "x"})]),
    ("gpt_oss", '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "y"}', "",
     [("search", {"query": "y"})]),  # <|call|> is a stop token: the output may end at the object
    ("gpt_oss", '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "a"}<|call|>'
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "B"}'
                "<|call|>Done.", "Done.", [("search", {"query": "a"}), ("get_weather", {"city": "B"})]),
]

# Malformed or truncated markup: the complete parse gives it back as content, untouched; streamed,
# a call whose name was already out has its arguments closed into a JSON object.
MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    ("qwen3_coder", "<tool_call>\n<oops>\n</tool_call> tail"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>"),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n{\"city\": \"Pa"),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + "{\"city\": broken}" + DS_CALL_END + DS_END),
    ("deepseek_v3", DS_BEGIN + "nope"),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "get_weather" + DS_SEP + "[1]" + DS_CALL_END),
    ("kimi_k2", K_BEGIN + K_CALL + "functions.get_weather:0" + K_ARGS + '{"city": "Os'),
    ("kimi_k2", K_BEGIN + K_CALL + "functions.get_weather:0" + K_ARGS + "nope" + K_CALL_END + K_END),
    ("kimi_k2", K_BEGIN + K_CALL + "bad id with spaces" + K_ARGS + "{}" + K_CALL_END + K_END),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city"),
    ("gpt_oss", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '),
    ("gpt_oss", '<|channel|>commentary to=functions.get_weather json<|message|>not json<|call|>'),
    ("gpt_oss", '<|channel|>final<|message|>stray header'),
]


def run(stages, pieces):
    content, reasoning, deltas = "", "", []
    for index, piece in enumerate(pieces + [""]):
        final = index == len(pieces)
        delta = OutputDelta(content=piece)
        for stage in stages:
            delta = stage.process(delta, final=final)
        content, reasoning, deltas = content + delta.content, reasoning + delta.reasoning_content, \
            deltas + delta.tool_calls
    return content, reasoning, deltas


def parse(parser_name, pieces, streaming=True, accept=None):
    options = {"streaming": streaming, "tools": TOOLS}
    if accept is not None:
        options["accept_name"] = accept
    content, _, deltas = run([ToolStage(TOOL_PARSERS[parser_name](**options))], list(pieces))
    return content, deltas


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_family_parser_table_complete_and_streamed(parser_name, text, content, calls):
    full_content, full_deltas = parse(parser_name, [text], streaming=False)
    full_calls = merge(full_deltas)
    assert full_content == content
    assert [(name, json.loads(arguments)) for _, name, arguments in full_calls] == calls
    for pieces in chunkings(text, len(text), most=9):
        streamed_content, deltas = parse(parser_name, pieces)
        streamed_calls = merge(deltas)
        assert streamed_content == content, pieces
        assert [(n, a) for _, n, a in streamed_calls] == [(n, a) for _, n, a in full_calls], pieces


@pytest.mark.parametrize("parser_name,text", MALFORMED)
def test_family_malformed_markup_is_content_never_an_error(parser_name, text):
    content, deltas = parse(parser_name, [text], streaming=False)
    assert (content, deltas) == (text, [])
    for pieces in chunkings(text, 3, most=9):
        _, deltas = parse(parser_name, pieces)
        for _, _, arguments in merge(deltas):
            assert isinstance(json.loads(arguments), dict)


def test_kimi_call_id_is_the_models_own():
    text = K_BEGIN + kimi("get_weather", 3, "{}") + K_END
    for streaming in (True, False):
        [(call_id, name, _)] = merge(parse("kimi_k2", list(text), streaming=streaming)[1])
        assert (call_id, name) == ("functions.get_weather:3", "get_weather")


@pytest.mark.parametrize("parser_name,text", [
    ("qwen3_coder", coder("other") + coder("search", query="x")),
    ("deepseek_v3", DS_BEGIN + ds_v31("other", "{}") + ds_v31("search", '{"query": "x"}') + DS_END),
    ("kimi_k2", K_BEGIN + kimi("other", 0, "{}") + kimi("search", 1, '{"query": "x"}') + K_END),
    ("glm45", glm("other") + glm("search", query="x")),
])
def test_named_tool_choice_accepts_only_that_function(parser_name, text):
    for streaming in (True, False):
        _, deltas = parse(parser_name, list(text), streaming=streaming, accept=lambda name: name == "search")
        assert [(n, json.loads(a)) for _, n, a in merge(deltas)] == [("search", {"query": "x"})]


@pytest.mark.parametrize("parser_name,markup", [("qwen3_coder", coder), ("glm45", glm)])
def test_xml_string_values_stream_as_they_come_typed_values_once_complete(parser_name, markup):
    _, deltas = parse(parser_name, list(markup("get_weather", city="Oslo", days=2)))
    fragments = [d.arguments for d in deltas if not d.name and d.arguments]
    # A string value's text goes out as it comes (the newline before qwen3_coder's `</parameter>`
    # held back: it is not part of the value); a typed one is known once complete, and the last
    # one at the call's end (a closing marker alone may be value text), with the closing brace.
    assert fragments == ['{"city": "', "O", "s", "l", "o", '"', ', "days": 2}']


@pytest.mark.parametrize("text,arguments", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", {"city": "Os"}),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nOs\n",
     {"days": 2, "city": "Os"}),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Os", {"city": "Os"}),
])
def test_a_streamed_string_value_cut_off_is_closed_into_valid_json(text, arguments):
    _, deltas = parse("qwen3_coder" if "<function=" in text else "glm45", list(text))
    [(_, name, streamed)] = merge(deltas)
    assert (name, json.loads(streamed)) == ("get_weather", arguments)


@pytest.mark.parametrize("raw,schema_type,unknown,expected", [
    ("Paris", "string", "string", "Paris"), ("42", "integer", "string", 42), ("4.5", "number", "string", 4.5),
    ("4", "number", "string", 4), ("True", "boolean", "string", True), ("false", "boolean", "string", False),
    ('{"a": 1}', "object", "string", {"a": 1}), ("{'a': (1, 2)}", "object", "string", {"a": [1, 2]}),
    ("[1, 2]", ["array", "null"], "string", [1, 2]), ("null", "integer", "string", None),
    ("12", None, "string", "12"), ("12", None, "json", 12), ("x y", None, "json", "x y"),
    ("not a number", "integer", "string", "not a number"), ("nan", "number", "string", "nan"),
])
def test_values_are_typed_by_the_schema(raw, schema_type, unknown, expected):
    value = typed_value(raw, schema_type, unknown)
    assert value == expected and type(value) is type(expected)


# -- harmony (gpt_oss reasoning + tool stages together)

HARMONY = [
    ("<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Hi!", "Think first.", []),
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
     "", "Need weather.", [("get_weather", {"city": "Oslo"})]),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "q"}',
     "Checking.", "a", [("search", {"query": "q"})]),
    ("plain text without harmony", "plain text without harmony", "", []),
    ("<|channel|>analysis<|message|>cut off in thou", "", "cut off in thou", []),
]


@pytest.mark.parametrize("text,content,reasoning,calls", HARMONY)
def test_harmony_channels_split_reasoning_content_and_calls(text, content, reasoning, calls):
    def stages(streaming):
        return [REASONING_PARSERS["gpt_oss"](False, None),
                ToolStage(TOOL_PARSERS["gpt_oss"](streaming=streaming, tools=TOOLS))]

    full = run(stages(False), [text])
    assert full[:2] == (content, reasoning)
    assert [(n, json.loads(a)) for _, n, a in merge(full[2])] == calls
    for pieces in chunkings(text, 7, most=9):
        streamed = run(stages(True), pieces)
        assert streamed[:2] == (content, reasoning), pieces
        assert [(n, a) for _, n, a in merge(streamed[2])] == [(n, a) for _, n, a in merge(full[2])]


# -- property: any arguments, any split, streamed == complete ---------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="<"),
                max_size=6)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e6, 1e6, allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
_arguments = st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), _values, max_size=4)
_SCHEMA_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"),
                 (list, "array"), (type(None), "null"))


def _schemas(calls):
    schemas = {}
    for name, arguments in calls:
        properties = {key: {"type": next(kind for cls, kind in _SCHEMA_TYPES if type(value) is cls)}
                      for key, value in arguments.items()}
        schemas[name] = {"type": "object", "properties": properties}
    return schemas


def _template_value(value, python_scalars: bool) -> str:
    """A value as the family's chat template writes it."""
    if isinstance(value, str):
        return value
    if python_scalars and not isinstance(value, (dict, list)):
        return str(value)  # Qwen3-Coder's template: `args_value | string`
    return json.dumps(value, ensure_ascii=False)


def _family_markup(parser_name: str, calls: list[tuple[str, dict]]) -> str:
    if parser_name == "deepseek_v3":
        form = [ds_v3, ds_v31]  # both forms, alternating
        return DS_BEGIN + "".join(form[i % 2](n, json.dumps(a, ensure_ascii=False))
                                  for i, (n, a) in enumerate(calls)) + DS_END
    if parser_name == "kimi_k2":
        return K_BEGIN + "".join(kimi(n, i, json.dumps(a)) for i, (n, a) in enumerate(calls)) + K_END
    if parser_name == "gpt_oss":
        return "".join(f"<|start|>assistant to=functions.{n}<|channel|>commentary json<|message|>{json.dumps(a)}"
                       "<|call|>" for n, a in calls)
    if parser_name == "qwen3_coder":
        return "\n".join(coder(n, **{k: _template_value(v, True) for k, v in a.items()}) for n, a in calls)
    return "".join(glm(n, **{k: _template_value(v, False) for k, v in a.items()}) for n, a in calls)


@pytest.mark.parametrize("parser_name", ["qwen3_coder", "deepseek_v3", "kimi_k2", "glm45", "gpt_oss"])
def test_family_any_arguments_any_split_stream_like_the_complete_parse(parser_name):
    @settings(max_examples=40, deadline=None, database=None)
    @given(calls=st.lists(st.tuples(st.sampled_from(["f", "get_weather", "a.b"]), _arguments), min_size=1, max_size=3),
           cuts=st.lists(st.integers(0, 400), max_size=12))
    def check(calls, cuts):
        names = [name for name, _ in calls]
        if len(set(names)) != len(names):  # one schema per name: keep the calls' names apart
            calls = [(f"{name}{i}", arguments) for i, (name, arguments) in enumerate(calls)]
        tools = _schemas(calls)
        text = _family_markup(parser_name, calls)

        def run_parser(pieces, streaming):
            stage = ToolStage(TOOL_PARSERS[parser_name](streaming=streaming, tools=tools))
            return run([stage], pieces)

        full_content, _, full_deltas = run_parser([text], False)
        full_calls = merge(full_deltas)
        assert [(n, json.loads(a)) for _, n, a in full_calls] == calls
        assert full_content == ""
        bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
        content, _, deltas = run_parser([text[a:b] for a, b in zip(bounds, bounds[1:])], True)
        assert content == ""
        assert [(n, a) for _, n, a in merge(deltas)] == [(n, a) for _, n, a in full_calls]

    check()


# -- real special tokens: the table fed one token id per engine message ------------------------
from family_tokenizers import ensure_family_tokenizer  # noqa: E402
from tito_derender.detokenizer import TextOptions  # noqa: E402
from tito_derender.domain import EngineOutput, FinishReason, RequestContext, ToolChoiceMode  # noqa: E402
from tito_derender.stream import DerenderStream  # noqa: E402
from tito_derender.tokenizer import TextTokenizer  # noqa: E402
from hf_reference import hf_of  # noqa: E402

FAMILY_OF_PARSER = {"qwen3_coder": "qwen3_coder", "deepseek_v3": "deepseek_v31", "kimi_k2": "kimi_k2",
                    "glm45": "glm45", "gpt_oss": "gpt_oss"}


@pytest.fixture(scope="module")
def family_tokenizers(model_cache):
    return {parser: TextTokenizer.load(ensure_family_tokenizer(family, model_cache))
            for parser, family in FAMILY_OF_PARSER.items()}


def stream_ids(tokenizer, ctx, ids, streaming=True):
    stream = DerenderStream(tokenizer, ctx, streaming=streaming)
    chunks = []
    for token_id in ids:
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    content = "".join(c.content for c in chunks)
    reasoning = "".join(c.reasoning_content for c in chunks)
    return content, reasoning, [d for c in chunks for d in c.tool_calls]


def family_context(parser_name, reasoning=""):
    return RequestContext(tool_parser=parser_name, reasoning_parser=reasoning, thinking_enabled=bool(reasoning),
                          tool_names=tuple(TOOLS), tool_choice=ToolChoiceMode.AUTO,
                          tool_schemas=tuple(TOOLS.items()), text=TextOptions(skip_special_tokens=False))


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_family_table_one_token_per_engine_message(family_tokenizers, parser_name, text, content, calls):
    tokenizer = family_tokenizers[parser_name]
    ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
    for marker in ("<tool_call>", "<｜tool▁sep｜>", "<|tool_call_begin|>", "<arg_key>", "<|message|>"):
        if marker in text:  # the family's markers are single tokens of its tokenizer
            assert hf_of(tokenizer).convert_tokens_to_ids(marker) in ids
    for streaming in (True, False):
        got_content, _, deltas = stream_ids(tokenizer, family_context(parser_name), ids, streaming)
        assert got_content == content
        assert [(n, json.loads(a)) for _, n, a in merge(deltas)] == calls


@pytest.mark.parametrize("parser_name,text", MALFORMED)
def test_family_malformed_one_token_per_engine_message(family_tokenizers, parser_name, text):
    tokenizer = family_tokenizers[parser_name]
    ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
    content, _, deltas = stream_ids(tokenizer, family_context(parser_name), ids, streaming=False)
    assert (content, deltas) == (text, [])
    _, _, deltas = stream_ids(tokenizer, family_context(parser_name), ids)
    for _, _, arguments in merge(deltas):
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("text,content,reasoning,calls", HARMONY)
def test_harmony_one_token_per_engine_message(family_tokenizers, text, content, reasoning, calls):
    tokenizer = family_tokenizers["gpt_oss"]
    ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
    for streaming in (True, False):
        got = stream_ids(tokenizer, family_context("gpt_oss", reasoning="gpt_oss"), ids, streaming)
        assert got[:2] == (content, reasoning)
        assert [(n, json.loads(a)) for _, n, a in merge(got[2])] == calls


_FUZZ_MARKUP = {
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=get_weather>", "<parameter=city>", "</parameter>",
                    "</function>", "\n", "Paris", "<think>", "</think>"],
    "deepseek_v3": [DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "get_weather", "\n```json\n", "```",
                    '{"city": "Oslo"}', "{", "}"],
    "kimi_k2": [K_BEGIN, K_END, K_CALL, K_ARGS, K_CALL_END, "functions.get_weather:0", '{"city": "Oslo"}', "{"],
    "glm45": ["<tool_call>", "</tool_call>", "get_weather", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "city", "3", "\n", "<think>", "</think>"],
    "gpt_oss": ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.get_weather",
                "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", '{"city": "Oslo"}', "{"],
}
_FUZZ_REASONING = {"qwen3_coder": "qwen3", "deepseek_v3": "deepseek_r1", "kimi_k2": "", "glm45": "qwen3",
                   "gpt_oss": "gpt_oss"}


@pytest.mark.parametrize("parser_name", sorted(_FUZZ_MARKUP))
def test_family_fuzzed_outputs_never_fail(family_tokenizers, parser_name):
    tokenizer = family_tokenizers[parser_name]
    pieces = [hf_of(tokenizer).encode(m, add_special_tokens=False) for m in _FUZZ_MARKUP[parser_name]]

    @settings(max_examples=40, deadline=None, database=None)
    @given(groups=st.lists(st.one_of(st.sampled_from(pieces), st.lists(st.integers(0, len(hf_of(tokenizer)) - 1),
                                                                       max_size=2)), max_size=25),
           streaming=st.booleans())
    def check(groups, streaming):
        ids = [i for group in groups for i in group]
        _, _, deltas = stream_ids(tokenizer, family_context(parser_name, _FUZZ_REASONING[parser_name]), ids, streaming)
        for _, _, arguments in merge(deltas):
            assert isinstance(json.loads(arguments), dict)

    check()


@pytest.mark.parametrize("parser_name,head,tail", [
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\n", "\n</parameter>\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>", "</arg_value>\n</tool_call>"),
])
def test_a_long_value_is_read_once_not_held_and_rescanned(parser_name, head, tail):
    """A value (a whole file, say) arrives token by token: the parser keeps at most a possible
    marker's start pending, so each character is scanned once, not once per token."""
    value = "line of code; " * 400
    parser = TOOL_PARSERS[parser_name](tools=TOOLS)
    events = parser.feed(head)
    for char in value:
        events += parser.feed(char)
        assert len(parser._held) < len("</parameter>")
    events += parser.feed(tail) + parser.finish()
    [(_, name, arguments)] = merge([event for event in events if isinstance(event, ToolCallDelta)])
    assert (name, json.loads(arguments)) == ("search", {"query": value})


def test_harmony_structure_is_parsed_even_with_thinking_off(family_tokenizers):
    text = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
    tokenizer = family_tokenizers["gpt_oss"]
    ctx = RequestContext(reasoning_parser="gpt_oss", thinking_enabled=False,
                         text=TextOptions(skip_special_tokens=False))
    content, reasoning, _ = stream_ids(tokenizer, ctx, hf_of(tokenizer).encode(text, add_special_tokens=False))
    assert (content, reasoning) == ("Hi!", "hmm")
