"""The incremental JSON lexer behind argument streaming: agrees with json.loads on validity,
finds member spans, and completes any valid prefix into valid JSON."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tito_derender.parsers.tools.json_scan import JsonLexer

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12)


def feed_all(lexer: JsonLexer, text: str, step: int) -> int:
    consumed = 0
    for start in range(0, len(text), step):
        piece = text[start:start + step]
        used = lexer.feed(piece)
        consumed += used
        if used < len(piece) or lexer.done or lexer.error:
            break
    return consumed


@settings(max_examples=150, deadline=None, database=None)
@given(arguments=st.dictionaries(st.text(max_size=5), json_values, max_size=4), indent=st.sampled_from([None, 2]),
       ascii_only=st.booleans(), step=st.integers(1, 9))
def test_valid_objects_are_read_with_their_member_spans(arguments, indent, ascii_only, step):
    arguments_json = json.dumps(arguments, indent=indent, ensure_ascii=ascii_only)
    text = '{"name": "f", "arguments": ' + arguments_json + "}"
    lexer = JsonLexer(object_only=True)
    assert feed_all(lexer, text + " trailing", step) == len(text)
    assert lexer.done and not lexer.error
    start, end = lexer.members["arguments"]
    assert json.loads(text[start:end]) == arguments
    assert json.loads(lexer.strings["name"]) == "f"
    # Every prefix, completed, is valid JSON (what a cut-off call's arguments become).
    for cut in range(start, end, max(1, (end - start) // 15)):
        prefix_lexer = JsonLexer(object_only=True)
        prefix_lexer.feed(text[:cut])
        assert not prefix_lexer.error
        assert isinstance(json.loads(text[start:cut] + prefix_lexer.completion(1)), dict) or cut == start


@settings(max_examples=200, deadline=None, database=None)
@given(text=st.text(alphabet='{}[]":,0123456789.eE+-truefalsn \\x', max_size=25))
def test_validity_agrees_with_json_loads(text):
    lexer = JsonLexer()
    consumed = lexer.feed(text)
    try:
        value = json.loads(text)
        valid = True
    except ValueError:
        valid = False
    if valid and not isinstance(value, (int, float)):  # a bare number never ends without a delimiter
        assert lexer.done and consumed == len(text.rstrip())
    if lexer.done:
        json.loads(text[:consumed])  # what the lexer accepted is JSON
    if lexer.error:
        assert not valid


def test_object_only_refuses_other_values():
    for text in ("[1]", '"x"', "1", "null"):
        lexer = JsonLexer(object_only=True)
        assert lexer.feed(text) == 0 and lexer.error
