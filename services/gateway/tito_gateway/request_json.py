"""A request body's JSON, checked once where it is read, so that nothing after the parse (protobuf,
the error reply, render) can fail on a value JSON allows but tito cannot carry.

- Nesting: at most `MAX_JSON_DEPTH` objects and arrays anywhere in the body (a body nested past
  the parser's own recursion, 100,000 deep, is refused alike). A value that becomes a protobuf
  Struct (a schema, tool parameters, chat_template_kwargs) nests at most `MAX_STRUCT_DEPTH`, as
  render takes it: protobuf's decoder stops a few levels past that, and its Struct conversion
  recurses once per level.
- Strings, keys included: JSON's `"\\ud800"` escape decodes to a lone UTF-16 surrogate, which is
  no Unicode character and which UTF-8 (protobuf strings, the reply) cannot encode.
- Integers: JSON has no bound, a protobuf number does; one past a double's range cannot be
  converted to any.

Each refusal is INVALID_ARGUMENT naming where it is (`messages[0].content`) as the field. The
parse is json's (C); the walk after it reads each value's type and a string's ASCII flag, not its
characters, so a 30 MB image costs it nothing and a long token-id prompt about what its parse costs.
"""

from __future__ import annotations

import json
from typing import Any

from tito.errors import InvalidArgument
from tito.json_text import JSON_TOO_DEEP, MAX_JSON_DEPTH, MAX_STRUCT_DEPTH

INVALID_JSON = "INVALID_JSON"
INVALID_REQUEST = "INVALID_REQUEST"
STRUCT_TOO_DEEP = "STRUCT_TOO_DEEP"

#: Bits of the largest integer a double holds (about 1.8e308): past it, float() overflows.
DOUBLE_INT_BITS = 1024
#: Characters of one key a field path repeats.
KEY_CHARS = 64

TOO_DEEP = f"nests more than {MAX_JSON_DEPTH} JSON objects and arrays"
LONE_SURROGATE = ("holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape that is not half of a pair), which is "
                  "not a Unicode character")
HUGE_NUMBER = "is a number beyond the range of a 64-bit float"


def loads(body: bytes) -> Any:
    """The body's JSON value, or INVALID_ARGUMENT: INVALID_JSON (not JSON, not Unicode text),
    JSON_TOO_DEEP or INVALID_REQUEST naming the position."""
    try:
        value = json.loads(_text(body), parse_constant=_refuse_constant)
    except RecursionError:  # nested past the parser's recursion, before any value was made
        raise _refusal(JSON_TOO_DEEP, [], TOO_DEEP) from None
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {str(exc)[:200]}", reason=INVALID_JSON) from None
    try:
        if type(value) is dict or type(value) is list:
            _walk(value, 0)
    except _Unfit as exc:
        raise _refusal(exc.reason, exc.path[::-1], exc.why) from None
    return value


def check_struct_depth(value: dict, field: str) -> None:
    """Refuse `value` (the request's `field`, about to become a Struct) when it nests past
    MAX_STRUCT_DEPTH: the Struct is level 1, each object or array inside one more."""
    inside = _past_struct_depth(value, 1)
    if inside is not None:
        raise InvalidArgument(f"{field} nests deeper than {MAX_STRUCT_DEPTH} levels (at {field_path(inside)})",
                              reason=STRUCT_TOO_DEEP, field=field,
                              metadata={"limit": "max_struct_depth", "max": str(MAX_STRUCT_DEPTH)})


def field_path(positions: list[str | int]) -> str:
    """`messages[0].content` from ["messages", 0, "content"]. A key is shown with its surrogates
    escaped and cut to KEY_CHARS, so the name is always text the reply can carry."""
    parts = []
    for position in positions:
        if isinstance(position, int):
            parts.append(f"[{position}]")
        else:
            key = position[:KEY_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
            parts.append(f".{key}" if parts else key)
    return "".join(parts)


def _text(body: bytes) -> str:
    # JSON is Unicode text: bytes that are not (a surrogate written as raw bytes included) are not
    # JSON, as the strict decoder says. json.loads(bytes) would let such surrogates through.
    try:
        return body.decode(json.detect_encoding(body))
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: not {exc.encoding} text ({exc.reason} at byte "
                              f"{exc.start})", reason=INVALID_JSON) from None


def _refuse_constant(value: str):
    raise ValueError(f"{value} is not JSON")


def _refusal(reason: str, positions: list[str | int], why: str) -> InvalidArgument:
    where = field_path(positions)
    metadata = {"limit": "max_json_depth", "max": str(MAX_JSON_DEPTH)} if reason == JSON_TOO_DEEP else None
    return InvalidArgument(f"{where or 'the request body'}: {why}", reason=reason, field=where or None,
                           metadata=metadata)


class _Unfit(Exception):
    """A value tito cannot carry: its `reason`, `why`, and where (`path`, innermost first, filled in
    while the walk unwinds)."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason
        self.why = why
        self.path: list[str | int] = []


def _walk(container: dict | list, depth: int) -> None:
    """Check what `container` (at nesting level depth + 1) holds; containers inside it are walked
    in turn, in the order of the text, to at most MAX_JSON_DEPTH levels (so this never recurses
    deeper than that either)."""
    if depth >= MAX_JSON_DEPTH:
        raise _Unfit(JSON_TOO_DEEP, TOO_DEEP)
    is_object = type(container) is dict
    for position, item in container.items() if is_object else enumerate(container):
        kind = type(item)  # scalars inline: a list of 200,000 token ids is one loop, not 200,000 calls
        try:
            if is_object and not _is_unicode(position):
                raise _Unfit(INVALID_REQUEST, LONE_SURROGATE)
            if kind is str:
                if not _is_unicode(item):
                    raise _Unfit(INVALID_REQUEST, LONE_SURROGATE)
            elif kind is int:
                if item.bit_length() > DOUBLE_INT_BITS:
                    raise _Unfit(INVALID_REQUEST, HUGE_NUMBER)
            elif kind is dict or kind is list:
                _walk(item, depth + 1)
        except _Unfit as exc:
            exc.path.append(position)
            raise


def _is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (only an ASCII flag is read for ASCII text)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _past_struct_depth(value: dict | list, level: int) -> list[str | int] | None:
    """The path (outermost first) to the first container inside `value` (a container at nesting
    `level`) that lies past MAX_STRUCT_DEPTH; None when none does."""
    for position, item in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(item, (dict, list)):
            if level >= MAX_STRUCT_DEPTH:
                return [position]
            inside = _past_struct_depth(item, level + 1)
            if inside is not None:
                return [position, *inside]
    return None
