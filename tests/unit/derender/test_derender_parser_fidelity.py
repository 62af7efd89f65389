"""Parser fidelity on the family formats, one table per class of real model output that a
reference parser gets right: each case is parsed whole, streamed one token id per engine message,
in random id groups and in random text pieces (parser_fidelity.check_case), and every streamed
parse equals the non-streamed one, which equals the expected result."""

from __future__ import annotations

import pytest

from family_tokenizers import ensure_family_tokenizer
from parser_fidelity import FAMILY_OF_PARSER, Case, case_id, check_case
from tito_derender.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizers(model_cache):
    return {family: TextTokenizer.load(ensure_family_tokenizer(family, model_cache))
            for family in set(FAMILY_OF_PARSER.values())}


def coder(name, **params):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def glm(name, **params):
    body = "".join(f"\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>" for key, value in params.items())
    return f"<tool_call>{name}{body}\n</tool_call>"


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
