"""The contract's structured-output constraint as data, and the one check render and engine share."""

from __future__ import annotations

import pytest
import xgrammar
from transformers import AutoTokenizer

from tito.errors import InvalidArgument
from tito.structured_output import (INVALID_STRUCTURED_OUTPUT, StructuredOutputSpec, grammar_of, spec_from_proto,
                                    validate)
from tito.v1 import sampling_pb2


@pytest.fixture(scope="module")
def compiler(tiny_text_model):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model))
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def accepts(compiler, spec: StructuredOutputSpec, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar_of(spec)))
    return matcher.accept_string(text) and matcher.is_completed()


def test_every_kind_of_the_proto_becomes_a_spec():
    cases = {
        "json_schema": sampling_pb2.StructuredOutput(json_schema='{"type": "integer"}'),
        "json_object": sampling_pb2.StructuredOutput(json_object=sampling_pb2.JsonObjectConstraint()),
        "regex": sampling_pb2.StructuredOutput(regex="a+"),
        "choice": sampling_pb2.StructuredOutput(choice=sampling_pb2.ChoiceConstraint(choices=["x", "y"])),
        "grammar": sampling_pb2.StructuredOutput(grammar='root ::= "a"'),
        "structural_tag": sampling_pb2.StructuredOutput(structural_tag="{}"),
    }
    for kind, message in cases.items():
        spec = spec_from_proto(message)
        assert spec.kind == kind and spec.field == f"sampling_params.structured_output.{kind}"
    assert spec_from_proto(sampling_pb2.StructuredOutput()) is None
    assert StructuredOutputSpec("regex", "a").key != StructuredOutputSpec("grammar", "a").key


def test_choices_are_matched_literally_whatever_they_contain(compiler):
    choices = ['say "hi"', "back\\slash", "two\nlines", "é and 東京", "a|b", "(x)*"]
    spec = StructuredOutputSpec.choice(choices)
    for choice in choices:
        assert accepts(compiler, spec, choice)
    assert not accepts(compiler, spec, "a")


def test_json_is_compact_and_bounded_strings_refuse_control_characters(compiler):
    spec = StructuredOutputSpec("json_schema", '{"type": "object", "properties": {"s": {"type": "string", '
                                               '"maxLength": 4}}, "required": ["s"]}')
    assert accepts(compiler, spec, '{"s": "ab"}')
    assert not accepts(compiler, spec, '{"s": "a\x01"}')  # raw control character: not JSON
    assert not accepts(compiler, spec, '{"s": "a\\n"}')  # xgrammar: no escapes in length-bounded strings
    free = StructuredOutputSpec("json_schema", '{"type": "string"}')
    assert accepts(compiler, free, '"a\\n\\"b"') and not accepts(compiler, free, '"a\x01"')
    assert not accepts(compiler, spec, '{ "s": "ab"}')  # no free whitespace


def test_a_bad_constraint_names_the_given_field_and_quotes_the_compiler():
    with pytest.raises(InvalidArgument) as caught:
        validate(StructuredOutputSpec("regex", "[a-"), field="response_format.x")
    assert caught.value.reason == INVALID_STRUCTURED_OUTPUT
    assert caught.value.violations[0].field == "response_format.x"
    assert caught.value.message.startswith("invalid regex constraint: Regex parsing error")
    with pytest.raises(InvalidArgument):
        validate(StructuredOutputSpec("grammar", ""))
