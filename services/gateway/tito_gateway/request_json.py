"""A request body's JSON, checked once where it is read, so that nothing after the parse (protobuf,
the error reply, render) can fail on a value JSON allows but tito cannot carry.

- Nesting: at most `MAX_JSON_DEPTH` containers anywhere in the body, measured on the text before
  `json.loads` recurses into it (a body nested 100,000 deep is refused, not a RecursionError); and
  a value that becomes a protobuf Struct (a schema, tool parameters, chat_template_kwargs) at most
  `MAX_STRUCT_DEPTH`, as render takes it: protobuf's decoder stops a few levels past that, and
  its Struct conversion recurses once per level.
- Strings, keys included: JSON's `"\\ud800"` escape decodes to a lone UTF-16 surrogate, which is
  no Unicode character and which UTF-8 (protobuf strings, the reply) cannot encode.
- Integers: JSON has no bound, a protobuf number does; one past a double's range cannot be
  converted to any.

Each refusal is INVALID_ARGUMENT naming where it is (`messages[0].content`) as the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tito.errors import InvalidArgument
from tito.json_text import JSON_TOO_DEEP, MAX_JSON_DEPTH, MAX_STRUCT_DEPTH, too_deep_at

INVALID_JSON = "INVALID_JSON"
INVALID_REQUEST = "INVALID_REQUEST"
STRUCT_TOO_DEEP = "STRUCT_TOO_DEEP"

#: Bits of the largest integer a double holds (about 1.8e308): past it, float() overflows.
DOUBLE_INT_BITS = 1024
#: Characters of one key a path repeats.
KEY_CHARS = 64

# What can decode to a value `_check_values` refuses: a surrogate escape (\ud800-\udfff; pairs
# that make one character are fine, and common, since Python's json.dumps escapes emoji so) or a
# run of digits as long as a double's largest integer. A body without either skips the walk.
_MAY_NEED_WALK = re.compile(r"\\u[dD][89a-fA-F]|[0-9]{309}")
# A JSON string, or a character that moves through the structure (keys, indices, nesting).
_PATH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


def loads(body: bytes) -> Any:
    """The body's JSON value, or INVALID_ARGUMENT: INVALID_JSON (not JSON, not Unicode),
    JSON_TOO_DEEP or INVALID_REQUEST naming the position."""
    text = _text(body)
    deep = too_deep_at(text)
    if deep is not None:
        where = path_at(text, deep)
        raise InvalidArgument(f"{where or 'the request body'}: nests more than {MAX_JSON_DEPTH} JSON objects and "
                              f"arrays", reason=JSON_TOO_DEEP, field=where or None,
                              metadata={"limit": "max_json_depth", "max": str(MAX_JSON_DEPTH)})
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {str(exc)[:200]}", reason=INVALID_JSON) from None
    if _MAY_NEED_WALK.search(text):
        _check(value)
    return value


def check_struct_depth(value: dict, field: str) -> None:
    """Refuse `value` (the request's `field`, about to become a Struct) when it nests past
    MAX_STRUCT_DEPTH: the Struct is level 1, each object or array inside one more."""
    inside = _past(value, 1)
    if inside is not None:
        raise InvalidArgument(f"{field} nests deeper than {MAX_STRUCT_DEPTH} levels (at {_path(inside)})",
                              reason=STRUCT_TOO_DEEP, field=field,
                              metadata={"limit": "max_struct_depth", "max": str(MAX_STRUCT_DEPTH)})


def path_at(text: str, offset: int) -> str:
    """Where `offset` of the JSON `text` lies, as the gateway names fields (`tools[0].function`);
    "" at the top. Reads the structure before it without parsing it (it may be nested past any
    parser's recursion)."""
    frames: list[list] = []  # per open container: [kind, key or index, a key comes next]
    for match in _PATH_TOKENS.finditer(text, 0, offset):
        token = match.group()
        if token in ("{", "["):
            frames.append([token, None if token == "{" else 0, token == "{"])
        elif not frames:
            continue
        elif token in ("}", "]"):
            frames.pop()
        elif token == ",":
            if frames[-1][0] == "[":
                frames[-1][1] += 1
            else:
                frames[-1][2] = True
        elif token == ":":
            frames[-1][2] = False
        elif frames[-1][0] == "{" and frames[-1][2]:
            frames[-1][1] = _key(token)
    return _path([position for _, position, _ in frames if position is not None])


def _text(body: bytes) -> str:
    # JSON is Unicode text: bytes that are not (a lone surrogate written as raw bytes included)
    # are not JSON, as the strict decoder says. json.loads itself would let such surrogates pass.
    try:
        return body.decode(json.detect_encoding(body))
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: not {exc.encoding} text ({exc.reason} at byte "
                              f"{exc.start})", reason=INVALID_JSON) from None


def _refuse_constant(value: str):
    raise ValueError(f"{value} is not JSON")


def _key(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:  # an escape JSON does not have; the parse that follows says so
        return token[1:-1]


class _Unfit(Exception):
    """A value protobuf cannot carry: `why`, and where (`path`, innermost first, filled in while
    the walk unwinds)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
        self.path: list[str | int] = []


def _check(value: Any) -> None:
    try:
        _walk(value)
    except _Unfit as exc:
        where = _path(exc.path[::-1])
        raise InvalidArgument(f"{where or 'the request body'}: {exc.why}", reason=INVALID_REQUEST,
                              field=where or None) from None


def _walk(value: Any) -> None:
    kind = type(value)
    if kind is str:
        _check_string(value)
    elif kind is int:
        if value.bit_length() > DOUBLE_INT_BITS:
            raise _Unfit("is a number beyond the range of a 64-bit float")
    elif kind is dict or kind is list:
        for position, item in value.items() if kind is dict else enumerate(value):
            try:
                if kind is dict:
                    _check_string(position)
                _walk(item)
            except _Unfit as exc:
                exc.path.append(position)
                raise


def _check_string(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _Unfit("holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape that is not half of a pair), "
                         "which is not a Unicode character") from None


def _past(value: dict | list, level: int) -> list[str | int] | None:
    """The path (outermost first) to the first container inside `value` (a container at nesting
    `level`) that lies past MAX_STRUCT_DEPTH; None when none does."""
    for position, item in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(item, (dict, list)):
            if level >= MAX_STRUCT_DEPTH:
                return [position]
            inside = _past(item, level + 1)
            if inside is not None:
                return [position, *inside]
    return None


def _path(positions: list[str | int]) -> str:
    """`messages[0].content` from ["messages", 0, "content"]; a key is shown with its surrogates
    escaped and cut to KEY_CHARS, so the name itself is always text the reply can carry."""
    parts = []
    for position in positions:
        if isinstance(position, int):
            parts.append(f"[{position}]")
        else:
            key = position[:KEY_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
            parts.append(f".{key}" if parts else key)
    return "".join(parts)
