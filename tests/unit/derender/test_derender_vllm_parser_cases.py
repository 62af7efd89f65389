"""vLLM's own tool-parser tests, ported as data: the model outputs of vLLM's
tests/tool_parsers/test_qwen3coder_tool_parser.py, test_kimi_k2_tool_parser.py and
test_glm4_moe_tool_parser.py (vllm-project/vllm), each with the calls vLLM's test expects. Each case
runs through parser_fidelity.check_case: parsed whole, streamed one token id per engine message, in
random id groups and in random text pieces, all of which must agree.

Where tito's answer differs from what vLLM's test asserts, the case says why (a `# differs:`
comment); the differences are the ones services/derender/README.md lists under "Where tito differs
from vLLM": whitespace right before a call is not content; text after or between calls is content;
a call whose arguments are not JSON is content when parsed whole, and closed into valid JSON when
streamed; a call's name must be one of the request's tools (vLLM's tests offer fewer tools than
they call, so each case here offers the ones it calls).
"""

from __future__ import annotations

import json

import pytest

from family_tokenizers import ensure_family_tokenizer
from parser_fidelity import FAMILY_OF_PARSER, Case, case_id, check_case, merge
from tito_derender.domain import FinishReason, OutputDelta
from tito_derender.parsers import tool_stage_for
from tito_derender.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizers(model_cache):
    return {family: TextTokenizer.load(ensure_family_tokenizer(family, model_cache))
            for family in {FAMILY_OF_PARSER[parser] for parser in ("qwen3_coder", "kimi_k2", "glm45")}}


def obj(**properties) -> dict:
    """A parameters schema declaring `properties` (name -> JSON type, or a whole schema)."""
    return {"type": "object", "properties": {name: kind if isinstance(kind, dict) else {"type": kind}
                                             for name, kind in properties.items()}}


# -- Qwen3-Coder (test_qwen3coder_tool_parser.py) -------------------------------------------------

WEATHER_PARAMS = dict(obj(city="string", state="string", unit={"type": "string", "enum": ["fahrenheit", "celsius"]}),
                      required=["city", "state"])
QWEN_TOOLS = {"get_current_weather": WEATHER_PARAMS,
              "calculate_area": obj(shape="string", dimensions="object", precision="integer")}


def weather(city: str, state: str, unit: str) -> str:
    return (f"<tool_call>\n<function=get_current_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            f"<parameter=state>\n{state}\n</parameter>\n<parameter=unit>\n{unit}\n</parameter>\n</function>\n"
            "</tool_call>")


def area(shape: str, dimensions: str, precision: int) -> str:
    return (f"<tool_call>\n<function=calculate_area>\n<parameter=shape>\n{shape}\n</parameter>\n"
            f"<parameter=dimensions>\n{dimensions}\n</parameter>\n<parameter=precision>\n{precision}\n</parameter>\n"
            "</function>\n</tool_call>")


def dallas(unit="fahrenheit"):
    return ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": unit})


def qwen(text, content, calls, label, tools=QWEN_TOOLS, **options):
    return Case("qwen3_coder", text, tools, content, calls, label=label, **options)


TYPES_TOOL = {"test_types": obj(int_param="integer", float_param="float", bool_param="boolean", str_param="string",
                                obj_param="object")}
ANYOF_TOOL = {"test_anyof": obj(
    anyof_int={"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
    anyof_str={"anyOf": [{"type": "string"}, {"type": "null"}]},
    anyof_array={"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    anyof_obj={"anyOf": [{"type": "object"}, {"type": "null"}]},
    type_as_array={"type": ["integer", "null"]},
    multi_non_null={"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]})}
SEARCH_TOOL = {"search_web": obj(query={"anyOf": [{"type": "string"}, {"type": "null"}]},
                                 count={"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
                                 verbose={"anyOf": [{"type": "boolean"}, {"type": "null"}]})}
MISSING_CLOSE = ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\n"
                 "Dallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n"
                 "</function>\n</tool_call>")
NO_GT = "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n</tool_call>"
NO_GT_THEN_VALID = ("<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_current_weather>\n<parameter=city>Dallas</parameter>\n"
                    "<parameter=state>TX</parameter>\n</function>\n</tool_call>")

QWEN_CASES = [
    qwen("This is a test response without any tool calls", "This is a test response without any tool calls", [],
         "no_tools"),
    qwen(weather("Dallas", "TX", "fahrenheit"), "", [dallas()], "single_tool"),
    qwen("Sure! Let me check the weather for you." + weather("Dallas", "TX", "fahrenheit"),
         "Sure! Let me check the weather for you.", [dallas()], "single_tool_with_content"),
    qwen(area("rectangle", '{"width": 10, \n "height": 20}', 2), "",
         [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
         "single_tool_multiline_param"),
    qwen(weather("Dallas", "TX", "fahrenheit") + "\n" + weather("Orlando", "FL", "celsius"), "",
         [dallas(), ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"})], "parallel_tools"),
    qwen("Let me calculate that area for you." + area("circle", '{"radius": 15.5}', 3),
         "Let me calculate that area for you.",
         [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})],
         "tool_with_typed_params"),
    qwen("<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n"
         "</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n</parameter>\n"
         '<parameter=obj_param>\n{"key": "value"}\n</parameter>\n</function>\n</tool_call>', "",
         [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                          "obj_param": {"key": "value"}})], "type_conversion", TYPES_TOOL),
    qwen("<tool_call>\n<function=test_anyof>\n<parameter=anyof_int>\n5\n</parameter>\n<parameter=anyof_str>\nhello\n"
         '</parameter>\n<parameter=anyof_array>\n["a", "b", "c"]\n</parameter>\n<parameter=anyof_obj>\n'
         '{"key": "value"}\n</parameter>\n<parameter=type_as_array>\n42\n</parameter>\n<parameter=multi_non_null>\n'
         "some text\n</parameter>\n</function>\n</tool_call>", "",
         [("test_anyof", {"anyof_int": 5, "anyof_str": "hello", "anyof_array": ["a", "b", "c"],
                          "anyof_obj": {"key": "value"}, "type_as_array": 42, "multi_non_null": "some text"})],
         "anyof_type_conversion", ANYOF_TOOL),
    qwen("<tool_call>\n<function=search_web>\n<parameter=query>\nvllm tool parser\n</parameter>\n"
         "<parameter=count>\n10\n</parameter>\n<parameter=verbose>\ntrue\n</parameter>\n</function>\n</tool_call>", "",
         [("search_web", {"query": "vllm tool parser", "count": 10, "verbose": True})],
         "anyof_type_conversion_streaming", SEARCH_TOOL),
    # `</parameter>` missing after Dallas: the `<parameter=state>` the tool declares ends the value
    # (it used to be part of it: "Dallas\n<parameter=state>\nTX"). vLLM asserts only that the
    # content holds the text; the newline before the call is not content (a documented difference).
    qwen(MISSING_CLOSE, "Let me check the weather for you:", [dallas()], "missing_closing_parameter_tag"),
    # test_extract_tool_calls_fallback_no_tags, test_extract_tool_calls_streaming_missing_opening_tag:
    # a call whose `<tool_call>` the model dropped
    qwen(weather("Dallas", "TX", "fahrenheit").removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"), "",
         [dallas()], "fallback_no_tags"),
    qwen("I'll check the weather for you.\n\n" + weather("Dallas", "TX", "fahrenheit").removeprefix("<tool_call>\n"),
         "I'll check the weather for you.", [dallas()], "missing_opening_tag"),
    # test_malformed_xml_no_gt_delimiter: vLLM asserts only that it does not crash; here the broken
    # header is no call: content, exactly the model's text
    qwen(NO_GT, NO_GT, [], "malformed_xml_no_gt_delimiter"),
    # test_none_tool_calls_filtered: the broken call is content, the valid one after it a call
    qwen(NO_GT_THEN_VALID, "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>",
         [("get_current_weather", {"city": "Dallas", "state": "TX"})], "none_tool_calls_filtered"),
    qwen('<tool_call>\n<function=update_record>\n<parameter=data>{"key": "value", "count": 42}</parameter>\n'
         "</function>\n</tool_call>", "", [("update_record", {"data": {"key": "value", "count": 42}})],
         "anyof_parameter_not_double_encoded", {"update_record": obj(data={"anyOf": [{"type": "object"},
                                                                                     {"type": "null"}]})}),
    qwen("<tool_call>\n<function=greet>\n<parameter=message>hello world</parameter>\n</function>\n</tool_call>", "",
         [("greet", {"message": "hello world"})], "no_double_serialization_string_args",
         {"greet": obj(message="string")}),
]


@pytest.mark.parametrize("case", QWEN_CASES, ids=case_id)
def test_vllm_qwen3_coder_cases(tokenizers, case):
    check_case(case, tokenizers)


# -- Kimi-K2 (test_kimi_k2_tool_parser.py) ------------------------------------------------------

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_BEGIN, ARG_BEGIN, TOOL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def tool(tool_id: str, arguments: str) -> str:
    """One call as vLLM's test writes it (a space after the id)."""
    return f"{TOOL_BEGIN}{tool_id} {ARG_BEGIN}{arguments}{TOOL_END}"


def wrap(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


KIMI_TOOLS = {"get_weather": obj(city="string", unit="string"), "get_news": obj(topic="string"),
              "send_email": obj(to="string", subject="string"), "process_html": obj(html="string"),
              "process_data": obj(name="string", value="integer"), "test": obj(), "bad": obj(city="string"),
              "good": obj(city="string"), "valid": obj(city="string"), "search": obj(q="string")}
# the tools vLLM's bare counter cases offer: only their schemas tell which one a call means
READ_FILE, WEATHER = {"read_file": obj(path="string")}, {"get_weather": obj(city="string", unit="string")}
BOOK_FLIGHT = {"book_flight": obj(city="string")}


def kimi(text, content, calls, label, tools=KIMI_TOOLS, **options):
    return Case("kimi_k2", text, tools, content, calls, label=label, **options)


KIMI_CASES = [
    kimi("This is a test", "This is a test", [], "no_tools"),
    # differs: vLLM keeps the space before the section in the content ("I'll check. ")
    kimi("I'll check. " + wrap(tool("functions.get_weather:0", '{"city": "Beijing"}')), "I'll check.",
         [("get_weather", {"city": "Beijing"})], "single_tool_call", ids=["functions.get_weather:0"]),
    kimi("Compare weather. " + wrap(tool("functions.get_weather:0", '{"city": "Beijing"}'),
                                    tool("functions.get_weather:1", '{"city": "Shanghai"}')), "Compare weather.",
         [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})], "parallel_tool_calls",
         ids=["functions.get_weather:0", "functions.get_weather:1"]),
    kimi("Multiple tasks. " + wrap(tool("functions.get_weather:0", '{"city": "New York"}'),
                                   tool("functions.get_news:1", '{"topic": "technology"}'),
                                   tool("functions.send_email:2",
                                        '{"to": "user@example.com", "subject": "Daily Update"}')),
         "Multiple tasks.", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                             ("send_email", {"to": "user@example.com", "subject": "Daily Update"})],
         "three_tool_calls"),
    kimi("Process HTML. " + wrap(tool("functions.process_html:0", '{"html": "<div>content</div>"}')), "Process HTML.",
         [("process_html", {"html": "<div>content</div>"})], "angle_brackets_in_json"),
    kimi("Formatted. " + wrap(tool("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')),
         "Formatted.", [("process_data", {"name": "test", "value": 123})], "multiline_json"),
    kimi("No prefix. " + wrap(tool("get_weather:0", '{"city": "Tokyo"}')), "No prefix.",
         [("get_weather", {"city": "Tokyo"})], "no_functions_prefix", ids=["get_weather:0"]),
    kimi("Empty args. " + wrap(tool("functions.test:0", "{}")), "Empty args.", [("test", {})], "empty_arguments"),
    # test_invalid_json_still_extracted. differs: vLLM returns the broken call with its invalid
    # arguments; whole, its markup is content; streamed, its arguments are closed. Either way the
    # call after it in the section is still a call (it used to be content too).
    kimi("Help. " + SECTION_BEGIN + tool("functions.bad:0", '{"city": "Beijing"')
         + tool("functions.good:1", '{"city": "Shanghai"}') + SECTION_END,
         "Help. " + SECTION_BEGIN + tool("functions.bad:0", '{"city": "Beijing"'), [("good", {"city": "Shanghai"})],
         "invalid_json_still_extracted",
         streamed_calls=[("bad", {"city": "Beijing"}), ("good", {"city": "Shanghai"})]),
    # test_invalid_funcall_id_skipped: an id that names no tool is no call (content)
    kimi("Help. " + SECTION_BEGIN + tool("functions.invalid.0", '{"city": "Beijing"}')
         + tool("functions.valid:1", '{"city": "Shanghai"}') + SECTION_END,
         "Help. " + SECTION_BEGIN + tool("functions.invalid.0", '{"city": "Beijing"}'),
         [("valid", {"city": "Shanghai"})], "invalid_funcall_id_skipped", ids=["functions.valid:1"]),
    kimi("Let me check. " + wrap(tool("0", '{"city": "Tokyo", "unit": "celsius"}')), "Let me check.",
         [("get_weather", {"city": "Tokyo", "unit": "celsius"})], "bare_counter", WEATHER, ids=["0"]),
    kimi("Let me check. " + wrap(tool("0", '{"city": "Tokyo", "unit": "celsius"}')), "Let me check.",
         [("get_weather", {"city": "Tokyo", "unit": "celsius"})], "bare_counter_multiple_tools_infers_by_args",
         READ_FILE | WEATHER, ids=["0"]),
    kimi("Let me check. " + wrap(tool("0", '{"city": "Tokyo"}')),
         "Let me check. " + wrap(tool("0", '{"city": "Tokyo"}')), [],
         "bare_counter_multiple_tools_ambiguous", WEATHER | BOOK_FLIGHT),
    kimi("Let me check. " + wrap(tool("0", '{"city": "Tokyo"')),
         "Let me check. " + wrap(tool("0", '{"city": "Tokyo"')), [],
         "bare_counter_multiple_tools_malformed_json", WEATHER | BOOK_FLIGHT),
    # differs: the single tool's broken arguments are content whole (vLLM returns them as they
    # are), closed into valid JSON streamed
    kimi("Let me check. " + wrap(tool("0", '{"city": "Tokyo"')), "Let me check. " + wrap(tool("0", '{"city": "Tokyo"')),
         [], "bare_counter_single_tool_invalid_json", WEATHER, streamed_calls=[("get_weather", {"city": "Tokyo"})]),
    # test_noise_between_markers_suppressed. differs: the text between the markers is content
    # (vLLM drops it); the call after it is a call (it used to be content too)
    kimi("Reasoning. " + SECTION_BEGIN + " spurious noise " + tool("functions.test:0", '{"k": "v"} ') + SECTION_END,
         "Reasoning. " + SECTION_BEGIN + " spurious noise", [("test", {"k": "v"})], "noise_between_markers"),
    # test_empty_tool_section: no call; a section that made none is content as written
    kimi("Reasoning. " + SECTION_BEGIN + SECTION_END, "Reasoning. " + SECTION_BEGIN + SECTION_END, [],
         "empty_tool_section"),
    # test_truncated_tool_call_no_end_marker. differs: streamed, the cut-off arguments are closed
    # into valid JSON (vLLM sends '{"city": "Bei'); whole, the unfinished call is content
    kimi("I'll check. " + SECTION_BEGIN + TOOL_BEGIN + "functions.get_weather:0 " + ARG_BEGIN + '{"city": "Bei',
         "I'll check. " + SECTION_BEGIN + TOOL_BEGIN + "functions.get_weather:0 " + ARG_BEGIN + '{"city": "Bei', [],
         "truncated_tool_call_no_end_marker", finish=FinishReason.LENGTH,
         streamed_calls=[("get_weather", {"city": "Bei"})]),
    # test_content_after_tool_section. differs: the text after the section is content (vLLM drops it)
    kimi("Before. " + wrap(tool("functions.get_weather:0", '{"city": "Tokyo"} ')) + " After tools.",
         "Before. After tools.", [("get_weather", {"city": "Tokyo"})], "content_after_tool_section"),
    kimi("Compare. " + wrap(tool("functions.search:0", '{"q": "cats"}'), tool("functions.search:1", '{"q": "dogs"}')),
         "Compare.", [("search", {"q": "cats"}), ("search", {"q": "dogs"})], "multiple_tool_calls_at_interval"),
]


@pytest.mark.parametrize("case", KIMI_CASES, ids=case_id)
def test_vllm_kimi_k2_cases(tokenizers, case):
    check_case(case, tokenizers)


# -- GLM-4.5 (test_glm4_moe_tool_parser.py) -----------------------------------------------------

GLM_TOOLS = {"get_current_weather": obj(city="string", state="string", unit="string"),
             "get_weather": obj(city="string"),
             "send_message": obj(recipient="string", message="string", priority="string"),
             "get_current_time": obj(), "get_time": obj(), "apply_diff": dict(obj(s="string"), required=["s"]),
             "calculate": {"type": "object"}}  # no properties: its values are JSON where they parse


def glm_call(name: str, *pairs: tuple[str, str], indent: str = "") -> str:
    body = "".join(f"\n{indent}<arg_key>{key}</arg_key>\n{indent}<arg_value>{value}</arg_value>"
                   for key, value in pairs)
    return f"<tool_call>{name}{body}\n{indent}</tool_call>"


def glm(text, content, calls, label, tools=GLM_TOOLS, **options):
    return Case("glm45", text, tools, content, calls, label=label, **options)


DALLAS_TX = (("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit"))
BEIJING = (("city", "Beijing"), ("date", "2025-08-01"))
INCOMPLETE = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
              "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>")
MALFORMED_KEY = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n"
                 "<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>")

GLM_CASES = [
    glm("This is a test", "This is a test", [], "no_tools"),
    glm(glm_call("get_current_weather", *DALLAS_TX, indent="    "), "",
        [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})], "single_tool_call"),
    glm(glm_call("get_current_weather", *DALLAS_TX, indent="    ") + "\n    "
        + glm_call("get_current_weather", ("city", "Orlando"), ("state", "FL"), ("unit", "fahrenheit"), indent="    "),
        "", [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
             ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})],
        "multiple_tool_calls"),
    # differs: vLLM keeps the space before the call in the content
    glm("I'll help you check the weather. "
        + glm_call("get_current_weather", ("city", "Seattle"), ("state", "WA"), ("unit", "celsius"), indent="    "),
        "I'll help you check the weather.",
        [("get_current_weather", {"city": "Seattle", "state": "WA", "unit": "celsius"})],
        "tool_call_with_content_before"),
    glm(glm_call("get_current_weather", ("city", "New York"), ("state", "NY"), ("unit", "celsius"), indent="    "), "",
        [("get_current_weather", {"city": "New York", "state": "NY", "unit": "celsius"})], "tool_call_with_mixed_args"),
    glm("I will help you get the weather." + glm_call("get_weather", *BEIJING, indent="    "),
        "I will help you get the weather.", [("get_weather", {"city": "Beijing", "date": "2025-08-01"})],
        "tool_call_with_chinese_content"),
    # no reasoning parser: the think block is content. differs: vLLM keeps the newline before the call
    glm("<think>I want to get the weather.</think>\n\nI will help you get the weather.\n"
        + glm_call("get_weather", *BEIJING),
        "<think>I want to get the weather.</think>\n\nI will help you get the weather.",
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"})], "with_thinking_tags"),
    glm("<tool_call>get_current_time\n</tool_call>", "", [("get_current_time", {})], "empty_arguments"),
    # differs: the text between the calls is content (vLLM's content is the text before the first)
    glm("I will help you get the weather info.\n\n" + glm_call("get_weather", *BEIJING)
        + "\n\nmeaningwhile, I will also check the weather in Shanghai.\n\n"
        + glm_call("get_weather", ("city", "Shanghai"), ("date", "2025-08-01")),
        "I will help you get the weather info.\n\nmeaningwhile, I will also check the weather in Shanghai.",
        [("get_weather", {"city": "Beijing", "date": "2025-08-01"}),
         ("get_weather", {"city": "Shanghai", "date": "2025-08-01"})], "mixed_content"),
    glm(glm_call("send_message", ("recipient", "Amy"), ("message", "It is a nice day"), ("priority", "high")), "",
        [("send_message", {"recipient": "Amy", "message": "It is a nice day", "priority": "high"})],
        "special_characters"),
    # test_extract_tool_calls_incomplete_tool_call: whole, the unfinished call is content, as in
    # vLLM. differs: streamed, its name is out and its arguments are closed
    glm(INCOMPLETE, INCOMPLETE, [], "incomplete_tool_call", finish=FinishReason.LENGTH,
        streamed_calls=[("get_weather", {"city": "Beijing"})]),
    # test_extract_tool_calls_malformed_xml: vLLM asserts only that it does not crash
    glm(MALFORMED_KEY, MALFORMED_KEY, [], "malformed_xml", streamed_calls=[("get_weather", {"city": "Seattle"})]),
    glm("<tool_call>apply_diff\n<arg_key>s</arg_key>\n<arg_value>    indented code    </arg_value>\n</tool_call>", "",
        [("apply_diff", {"s": "    indented code    "})], "whitespace_preserved_in_arg_values"),
    glm("<tool_call>get_time\n</tool_call>", "", [("get_time", {})], "zero_argument_tool_call"),
    glm("<tool_call>   ", "<tool_call>   ", [], "malformed_tool_call_no_regex_match"),
    glm("<tool_call></tool_call>", "<tool_call></tool_call>", [], "streaming_empty_tool_call"),
    glm(glm_call("send_message", ("greeting", "你好世界"), ("emoji", "🎉")), "",
        [("send_message", {"greeting": "你好世界", "emoji": "🎉"})], "unicode_characters_preserved"),
    glm('<tool_call>send_message\n<arg_key>message</arg_key><arg_value>Hello "world"\nNew line</arg_value></tool_call>',
        "", [("send_message", {"message": 'Hello "world"\nNew line'})], "json_escape_in_string"),
    glm(glm_call("calculate", ("operation", "add"), ("a", "42"), ("b", "3.14"), ("enabled", "true")), "",
        [("calculate", {"operation": "add", "a": 42, "b": 3.14, "enabled": True})], "numeric_deserialization"),
    glm("<tool_call>calculate\n<arg_key>operation</arg_key><arg_value>add</arg_value><arg_key>a</arg_key>"
        "<arg_value>42</arg_value><arg_key>b</arg_key><arg_value>3.14</arg_value></tool_call>", "",
        [("calculate", {"operation": "add", "a": 42, "b": 3.14})], "multi_token_with_multiple_args",
        {"calculate": obj(operation="string", a="number", b="number")}),
    glm("Checking Beijing.\n<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>"
        "\nAlso Shanghai.\n<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Shanghai</arg_value></tool_call>",
        "Checking Beijing.\nAlso Shanghai.",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})],
        "content_between_tool_calls"),
]


@pytest.mark.parametrize("case", GLM_CASES, ids=case_id)
def test_vllm_glm45_cases(tokenizers, case):
    check_case(case, tokenizers)


BUBBLE_SORT = '''#!/usr/bin/env python3
"""Bubble Sort Implementation"""

def bubble_sort(arr):
    n = len(arr)
    for i in range(n):
        swapped = False
        for j in range(0, n - i - 1):
            if arr[j] > arr[j + 1]:
                arr[j], arr[j + 1] = arr[j + 1], arr[j]
                swapped = True
        if not swapped:
            break
    return arr
'''
WRITE_TO_FILE = {"write_to_file": obj(file_path="string", content="string")}


@pytest.mark.parametrize("parser,text", [
    ("glm45", "<tool_call>write_to_file\n<arg_key>file_path</arg_key><arg_value>src/bubble_sort.py</arg_value>"
              f"<arg_key>content</arg_key><arg_value>{BUBBLE_SORT}</arg_value></tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=write_to_file>\n<parameter=file_path>\nsrc/bubble_sort.py\n</parameter>\n"
                    f"<parameter=content>\n{BUBBLE_SORT}\n</parameter>\n</function>\n</tool_call>"),
])
def test_a_long_string_value_streams_as_it_is_written(parser, text):
    """vLLM's test_streaming_long_content_incremental (its issue 32829): a file a tool writes
    streams line by line, not in one piece once the value is complete."""
    stage = tool_stage_for(Case(parser, text, WRITE_TO_FILE, "", []).context())
    lines = text.splitlines(keepends=True)
    deltas = [call for index, line in enumerate(lines + [""])
              for call in stage.process(OutputDelta(content=line), final=index == len(lines)).tool_calls]
    [(_, name, arguments)] = merge(deltas)
    expected = {"file_path": "src/bubble_sort.py", "content": BUBBLE_SORT}
    assert (name, json.loads(arguments)) == ("write_to_file", expected)
    assert len([delta for delta in deltas if delta.arguments]) >= len(BUBBLE_SORT.splitlines())
