"""Parser fidelity on the family formats, one table per class of real model output that a
reference parser gets right: each case is parsed whole, streamed one token id per engine message,
in random id groups and in random text pieces (parser_fidelity.check_case), and every streamed
parse equals the non-streamed one, which equals the expected result."""

from __future__ import annotations

import pytest

from family_tokenizers import ensure_family_tokenizer
from markup_calls import coder, glm
from parser_fidelity import FAMILY_OF_PARSER, Case, case_id, check_case
from tito_derender.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizers(model_cache):
    return {family: TextTokenizer.load(ensure_family_tokenizer(family, model_cache))
            for family in set(FAMILY_OF_PARSER.values())}


XML_FORMATS = {"qwen3_coder": coder, "glm45": glm}


# -- 1. values typed by the schema: anyOf / oneOf / nullable / $ref / enum ---------------------

OPTIONAL_INT = {"anyOf": [{"type": "integer"}, {"type": "null"}]}  # Pydantic's Optional[int]
INT_OR_STR = {"anyOf": [{"type": "integer"}, {"type": "string"}]}  # int | str
DICT_OR_NONE = {"anyOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}]}
LIST_OR_NONE = {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}
OPTIONAL_STR = {"anyOf": [{"type": "string"}, {"type": "null"}]}
NUMBER_OR_BOOL = {"oneOf": [{"type": "number"}, {"type": "boolean"}]}
NULLABLE_INT = {"type": "integer", "nullable": True}  # OpenAPI 3.0's spelling
TYPE_LIST = {"type": ["integer", "null"]}
REF_COUNT = {"$ref": "#/$defs/Count"}
ENUM_INTS = {"enum": [1, 2, 3]}
ALL_OF_INT = {"allOf": [{"type": "integer"}], "description": "one of Pydantic's wrappers"}
DEFAULT_NULL = {"default": None, "anyOf": [{"type": "number"}, {"type": "null"}], "title": "Ratio"}

TYPED = [
    # (label, property schema, raw value as the model writes it, the JSON value it means)
    ("optional-int-5", OPTIONAL_INT, "5", 5),
    ("optional-int-None", OPTIONAL_INT, "None", None),
    ("optional-int-null", OPTIONAL_INT, "null", None),
    ("int-or-str-42", INT_OR_STR, "42", 42),
    ("int-or-str-text", INT_OR_STR, "forty two", "forty two"),
    ("dict-or-none-object", DICT_OR_NONE, '{"key": "value"}', {"key": "value"}),
    ("dict-or-none-None", DICT_OR_NONE, "None", None),
    ("dict-or-none-python", DICT_OR_NONE, "{'key': True}", {"key": True}),
    ("list-or-none", LIST_OR_NONE, "[1, 2]", [1, 2]),
    ("optional-str-text", OPTIONAL_STR, "hello world", "hello world"),
    ("optional-str-null", OPTIONAL_STR, "null", None),
    ("number-or-bool-true", NUMBER_OR_BOOL, "true", True),
    ("number-or-bool-2.5", NUMBER_OR_BOOL, "2.5", 2.5),
    ("nullable-int", NULLABLE_INT, "7", 7),
    ("nullable-int-null", NULLABLE_INT, "null", None),
    ("type-list-null", TYPE_LIST, "None", None),
    ("ref", REF_COUNT, "3", 3),
    ("enum-ints", ENUM_INTS, "2", 2),
    ("all-of-int", ALL_OF_INT, "12", 12),
    ("default-null-number", DEFAULT_NULL, "0.25", 0.25),
    ("default-null-None", DEFAULT_NULL, "None", None),
]


def typed_tools(schema: dict) -> dict[str, dict]:
    return {"f": {"type": "object", "properties": {"v": schema, "s": {"type": "string"}},
                  "$defs": {"Count": {"type": "integer", "minimum": 0}}}}


TYPED_CASES = [Case(parser, markup("f", v=raw, s="kept"), typed_tools(schema), "", [("f", {"v": value, "s": "kept"})],
                    label=label)
               for parser, markup in XML_FORMATS.items() for label, schema, raw, value in TYPED]


@pytest.mark.parametrize("case", TYPED_CASES, ids=case_id)
def test_values_are_typed_by_anyof_oneof_nullable_ref_and_enum_schemas(tokenizers, case):
    check_case(case, tokenizers)


# -- 2. gpt_oss output that ends inside a harmony header: nothing of a header is content --------

WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
           "search": {"type": "object", "properties": {"query": {"type": "string"}}}}
ANALYSIS = "<|channel|>analysis<|message|>Let me think.<|end|>"


def harmony(text, content="", reasoning="Let me think.", calls=(), label=""):
    from tito_derender.domain import FinishReason
    return Case("gpt_oss", text, WEATHER, content, list(calls), reasoning=reasoning, reasoning_parser="gpt_oss",
                finish=FinishReason.LENGTH, label=label)


TRUNCATED_HEADERS = [
    harmony(ANALYSIS + "<|start|>assistant<|channel|>final", label="final-channel"),
    harmony(ANALYSIS + "<|start|>assistant<|channel|>fin", label="channel-name-cut"),
    harmony(ANALYSIS + "<|start|>assistant", label="role"),
    harmony(ANALYSIS + "<|start|>", label="start"),
    harmony(ANALYSIS + "<|start|>assistant to=functions.get_weather<|channel|>commentary json", label="call-header"),
    harmony(ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json",
            label="call-header-constrain"),
    harmony("<|channel|>final", reasoning="", label="first-header"),
    harmony("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|end|>"
            "<|start|>assistant<|channel|>", content="Hi!", reasoning="a", label="after-an-answer"),
    harmony(ANALYSIS + '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "x"}'
            "<|call|><|start|>assistant<|channel|>fi", calls=[("search", {"query": "x"})], label="after-a-call"),
]


@pytest.mark.parametrize("case", TRUNCATED_HEADERS, ids=case_id)
def test_output_ending_inside_a_harmony_header_keeps_no_header_text(tokenizers, case):
    check_case(case, tokenizers)


# -- 3. a call's name: a valid function name, and one of the tools -----------------------------

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TEMPLATE_NAME = "{{ tc.name }}"
# A tool the caller named so: among the tools, but still no function name.
ODD_TOOLS = dict(WEATHER, **{TEMPLATE_NAME: {"type": "object", "properties": {}}})


def ds(name, arguments="{}"):
    return f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}"


def kimi(call_id, arguments="{}"):
    return f"{K_CALL}{call_id}{K_ARGS}{arguments}{K_CALL_END}"


def oss(name, arguments="{}"):
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>"


def markup_of(parser: str, name: str) -> str:
    """One call to `name` (no arguments) in `parser`'s format."""
    return {"hermes": f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>',
            "llama3_json": f'{{"name": "{name}", "parameters": {{}}}}',
            "mistral": f'[TOOL_CALLS][{{"name": "{name}", "arguments": {{}}}}]',
            "pythonic": f"[{name}()]",
            "qwen3_coder": coder(name), "glm45": glm(name),
            "deepseek_v3": DS_BEGIN + ds(name) + DS_END,
            "kimi_k2": K_BEGIN + kimi(f"functions.{name}:0") + K_END,
            "gpt_oss": oss(name)}[parser]


ALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "glm45", "deepseek_v3", "kimi_k2",
               "gpt_oss")
BAD_NAMES = {"not-among-tools": ("get_time", WEATHER), "template-text": (TEMPLATE_NAME, ODD_TOOLS),
             "leading-digit": ("9lives", dict(WEATHER, **{"9lives": {}}))}


# A call that is not a call leaves all its text as content (a DeepSeek / Kimi section's end
# included: a section that made no call is no call markup).
NAME_CASES = [Case(parser, markup_of(parser, name), tools, markup_of(parser, name), [], label=label)
              for parser in ALL_PARSERS for label, (name, tools) in BAD_NAMES.items()
              # pythonic's grammar has no name with spaces or a leading digit: not a call either way
              if not (parser == "pythonic" and label != "not-among-tools")]
NAME_CASES += [Case(parser, markup_of(parser, "get_weather"), WEATHER, "", [("get_weather", {})], label="known")
               for parser in ALL_PARSERS]
NAME_CASES += [
    # streamed, a broken header used to send this as a name: "get_weather\n<parameter=city"
    Case("qwen3_coder", "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>", WEATHER,
         "<tool_call>\n<function=get_weather\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", [],
         label="broken-header"),
    Case("glm45", "<tool_call>get weather now\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
         WEATHER, "<tool_call>get weather now\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
         [], label="spaces"),
    # in a section, the calls beside a bad one are still calls
    Case("deepseek_v3", DS_BEGIN + ds("get_time") + ds("search", '{"query": "x"}') + DS_END, WEATHER,
         DS_BEGIN + DS_CALL + "get_time" + DS_SEP + "{}" + DS_CALL_END, [("search", {"query": "x"})], label="section"),
    Case("kimi_k2", K_BEGIN + kimi("functions.get_time:0") + kimi("functions.search:1", '{"query": "x"}') + K_END,
         WEATHER, K_BEGIN + K_CALL + "functions.get_time:0" + K_ARGS + "{}" + K_CALL_END, [("search", {"query": "x"})],
         label="section"),
]


@pytest.mark.parametrize("case", NAME_CASES, ids=case_id)
def test_a_call_names_a_valid_function_among_the_tools(tokenizers, case):
    check_case(case, tokenizers)


# -- 4. kimi_k2 ids that are only the call counter ----------------------------------------------

ONE_TOOL = {"get_weather": WEATHER["get_weather"]}
# vLLM's tests' tools for bare counter ids: two of them take a city
BARE_TOOLS = {"read_file": {"type": "object", "properties": {"path": {"type": "string"}}},
              "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
              "book_flight": {"type": "object", "properties": {"city": {"type": "string"}}}}
REQUIRED_DATE = dict(BARE_TOOLS, book_flight={"type": "object", "properties": {"city": {}, "date": {}},
                                              "required": ["date"]})
BARE_IDS = [
    Case("kimi_k2", K_BEGIN + kimi("0", '{"city": "Oslo"}') + K_END, ONE_TOOL, "", [("get_weather", {"city": "Oslo"})],
         ids=["0"], label="one-tool"),
    Case("kimi_k2", K_BEGIN + kimi(" 3 ", '{"city": "Oslo"}') + K_END, ONE_TOOL, "",
         [("get_weather", {"city": "Oslo"})], ids=["3"], label="spaced"),
    Case("kimi_k2", K_BEGIN + kimi("0", '{"query": "x"}') + K_END, WEATHER, "", [("search", {"query": "x"})],
         tool_choice="search", ids=["0"], label="named-choice"),
    # several tools: the one the arguments fit (vLLM's test_bare_counter_multiple_tools_*)
    Case("kimi_k2", K_BEGIN + kimi("0", '{"city": "Oslo", "unit": "C"}') + K_END, BARE_TOOLS, "",
         [("get_weather", {"city": "Oslo", "unit": "C"})], ids=["0"], label="fitting-arguments"),
    Case("kimi_k2", K_BEGIN + kimi("0", '{"city": "Oslo"}') + K_END, BARE_TOOLS,
         K_BEGIN + kimi("0", '{"city": "Oslo"}') + K_END, [], label="ambiguous"),
    Case("kimi_k2", K_BEGIN + kimi("0", '{"path": "a", "mode": 1}') + K_END, BARE_TOOLS,
         K_BEGIN + kimi("0", '{"path": "a", "mode": 1}') + K_END, [], label="fitting-no-tool"),
    Case("kimi_k2", K_BEGIN + kimi("0", '{"city": "Oslo"}') + kimi("functions.read_file:1", '{"path": "a"}') + K_END,
         BARE_TOOLS, K_BEGIN + kimi("0", '{"city": "Oslo"}'), [("read_file", {"path": "a"})],
         ids=["functions.read_file:1"], label="ambiguous-then-named"),
    # book_flight requires a date: {"city"} fits get_weather alone, {"city", "date"} book_flight
    Case("kimi_k2", K_BEGIN + kimi("0", '{"city": "Oslo"}') + kimi("1", '{"city": "Oslo", "date": "today"}') + K_END,
         REQUIRED_DATE, "", [("get_weather", {"city": "Oslo"}), ("book_flight", {"city": "Oslo", "date": "today"})],
         ids=["0", "1"], label="required-properties"),
    Case("kimi_k2", K_BEGIN + kimi("functions.get_weather:0", '{"city": "A"}') + kimi("1", '{"city": "B"}') + K_END,
         ONE_TOOL, "", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})],
         ids=["functions.get_weather:0", "1"], label="after-a-full-id"),
]


@pytest.mark.parametrize("case", BARE_IDS, ids=case_id)
def test_kimi_bare_counter_ids_call_the_only_tool_or_the_one_the_arguments_fit(tokenizers, case):
    check_case(case, tokenizers)


# -- 5. a call opened while the reasoning is still open ends the reasoning ---------------------

CALL_OF = {  # parser -> (one call to get_weather(city=Oslo), one to search(query=x))
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
               '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'),
    "qwen3_coder": (coder("get_weather", city="Oslo"), coder("search", query="x")),
    "glm45": (glm("get_weather", city="Oslo"), glm("search", query="x")),
    "deepseek_v3": (DS_BEGIN + ds("get_weather", '{"city": "Oslo"}') + DS_END,
                    DS_BEGIN + ds("search", '{"query": "x"}') + DS_END),
    "kimi_k2": (K_BEGIN + kimi("functions.get_weather:0", '{"city": "Oslo"}') + K_END,
                K_BEGIN + kimi("functions.search:1", '{"query": "x"}') + K_END),
}
REASONING_OF = {"hermes": ("qwen3",), "qwen3_coder": ("qwen3",), "glm45": ("qwen3",), "kimi_k2": ("qwen3",),
                "deepseek_v3": ("qwen3", "deepseek_r1")}
OSLO, QUERY = ("get_weather", {"city": "Oslo"}), ("search", {"query": "x"})


def reasoning_cases(parser: str, reasoning_parser: str) -> list[Case]:
    call, other = CALL_OF[parser]
    opened = reasoning_parser == "deepseek_r1"  # R1's output starts as reasoning
    think = "" if opened else "<think>"

    def case(text, content, reasoning, calls, label, prompt_opens=False):
        return Case(parser, text, WEATHER, content, calls, reasoning=reasoning, reasoning_parser=reasoning_parser,
                    prompt_opens_reasoning=prompt_opens, label=f"{reasoning_parser}-{label}")

    cases = [
        case(think + "Let me check the weather.\n\n" + call, "", "Let me check the weather.\n\n", [OSLO], "one-call"),
        case(think + "Two lookups." + call + "\n" + other, "", "Two lookups.", [OSLO, QUERY], "two-calls"),
        case(think + "Maybe " + call + " or not.</think>It is sunny.", "It is sunny.",
             "Maybe " + call + " or not.", [], "thinking-about-a-call"),
        case(think + "Hmm " + call + "</think>Done.", "Done.", "Hmm " + call, [], "closed-after-the-call"),
        case(think + "Hmm " + call + " more thought", "", "Hmm " + call + " more thought", [], "text-after-the-call"),
    ]
    if not opened:
        cases.append(case("I need the weather.\n" + call, "", "I need the weather.\n", [OSLO], "prompt-opened",
                          prompt_opens=True))
    return cases


REASONING_CASES = [case for parser, names in REASONING_OF.items() for name in names
                   for case in reasoning_cases(parser, name)]


@pytest.mark.parametrize("case", REASONING_CASES, ids=case_id)
def test_a_call_opened_inside_the_reasoning_ends_it(tokenizers, case):
    check_case(case, tokenizers)


# -- 6. values that hold markup themselves (code, XML, HTML a tool writes) ---------------------

FILES = {"write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                                          "mode": {"type": "integer"}}}}
MARKUP_VALUES = [
    ("parameter-open", 'print("<parameter=city>")'),
    ("parameter-close", "x = '</parameter>' + y"),
    ("parameter-close-then-line", "a</parameter>\nb"),
    ("parameter-close-last", "ends with </parameter>"),
    ("tool-call-open", "<tool_call> is the marker"),
    ("tool-call-close", "then </tool_call> and more"),
    ("function-close", "end </function> here"),
    ("function-open", "<function=evil>\nbody"),
    ("html", "<html>\n<body>\n<p>Hi</p>\n</body>\n</html>\n"),
    ("arg-markers", "<arg_key>k</arg_key>\n<arg_value>v</arg_value> and </arg_value> text"),
    ("xml-call-in-prose", "Qwen writes <parameter=k>\nv\n</parameter> then more"),
]


def markup_value_cases() -> list[Case]:
    cases = []
    for label, value in MARKUP_VALUES:
        arguments = {"path": "a.txt", "content": value, "mode": 420}
        cases.append(Case("qwen3_coder", coder("write_file", path="a.txt", content=value, mode="420"), FILES, "",
                          [("write_file", arguments)], label=label))
        if "</arg_value>\n<arg_key>" not in value and "</arg_value></tool_call>" not in value:
            cases.append(Case("glm45", glm("write_file", path="a.txt", content=value, mode="420"), FILES, "",
                              [("write_file", arguments)], label=label))
    # two calls, the first writing markup: the second is still its own call
    value = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\nmore"
    cases.append(Case("qwen3_coder", coder("write_file", content=value) + "\n" + coder("write_file", path="b"), FILES,
                      "", [("write_file", {"content": value}), ("write_file", {"path": "b"})], label="two-calls"))
    cases.append(Case("glm45", glm("write_file", content=value) + "\n" + glm("write_file", path="b"), FILES, "",
                      [("write_file", {"content": value}), ("write_file", {"path": "b"})], label="two-calls"))
    # the JSON formats carry markup in JSON strings
    content = "a </tool_call> <｜tool▁call▁end｜> <|tool_call_end|> <|call|> b"
    arguments = '{"content": ' + __import__("json").dumps(content, ensure_ascii=False) + "}"
    cases += [
        Case("hermes", f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>', FILES, "",
             [("write_file", {"content": content})], label="json-string"),
        Case("deepseek_v3", DS_BEGIN + ds("write_file", arguments) + DS_END, FILES, "",
             [("write_file", {"content": content})], label="json-string"),
        Case("kimi_k2", K_BEGIN + kimi("functions.write_file:0", arguments) + K_END, FILES, "",
             [("write_file", {"content": content})], label="json-string"),
        Case("gpt_oss", oss("write_file", arguments), FILES, "", [("write_file", {"content": content})],
             label="json-string"),
    ]
    return cases


@pytest.mark.parametrize("case", markup_value_cases(), ids=case_id)
def test_a_value_that_holds_markup_is_kept_whole(tokenizers, case):
    check_case(case, tokenizers)


DROPPED_CLOSES = [
    # models that drop `</parameter>` (and `</tool_call>`): still one parameter per `<parameter=`
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n<parameter=mode>\n7\n"
         "</function>\n</tool_call>", FILES, "", [("write_file", {"path": "a.txt", "mode": 7})], label="no-closes"),
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</function>", FILES, "",
         [("write_file", {"path": "a.txt"})], label="no-closes-at-the-end"),
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n</function>",
         FILES, "", [("write_file", {"path": "a.txt"})], label="no-tool-call-close"),
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n\n"
         "<parameter=mode>\n1\n</parameter>\n\n</function>\n\n</tool_call>", FILES, "",
         [("write_file", {"path": "a", "mode": 1})], label="blank-lines"),
    # vLLM's test_extract_tool_calls_missing_closing_parameter_tag: a `<parameter=NAME>` naming an
    # argument of the tool not given yet ends the open value; it used to swallow the next parameter
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n<parameter=mode>\n7\n"
         "</parameter>\n<parameter=content>\nhi\n</parameter>\n</function>\n</tool_call>", FILES, "",
         [("write_file", {"path": "a.txt", "mode": 7, "content": "hi"})], label="one-close-dropped"),
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=content>\nx\n<parameter=path>\na.txt\n"
         "<parameter=mode>\n7\n</function>\n</tool_call>", FILES, "",
         [("write_file", {"content": "x", "path": "a.txt", "mode": 7})], label="every-close-dropped"),
    # ... but a `<parameter=NAME>` for an argument already given is text of the value
    Case("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
         "<parameter=content>\nuse <parameter=path> here\n</parameter>\n</function>\n</tool_call>", FILES, "",
         [("write_file", {"path": "a.txt", "content": "use <parameter=path> here"})], label="given-name-in-a-value"),
    Case("glm45", "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.txt<arg_key>mode</arg_key>\n"
         "<arg_value>7</arg_value>\n</tool_call>", FILES, "", [("write_file", {"path": "a.txt", "mode": 7})],
         label="arg-value-close-dropped"),
    Case("glm45", "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.txt</arg_value>\n"
         "<arg_key>content</arg_key>\n<arg_value>see <arg_key>path</arg_key> here</arg_value>\n</tool_call>", FILES, "",
         [("write_file", {"path": "a.txt", "content": "see <arg_key>path</arg_key> here"})],
         label="given-name-in-a-value"),
]


@pytest.mark.parametrize("case", DROPPED_CLOSES, ids=case_id)
def test_dropped_closing_markers_still_end_values(tokenizers, case):
    check_case(case, tokenizers)
