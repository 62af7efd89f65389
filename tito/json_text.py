"""JSON text a request carries, checked before it is parsed.

`json.loads` recurses once per container, so a text nested thousands deep (`[[[[...`) raises
RecursionError, and a value just under the interpreter's limit still recurses again wherever it
is walked (a chat template, a grammar compiler). `json_depth` measures the nesting without
parsing (no recursion, one regex pass), so a service refuses such text as the caller's error
(`JSON_TOO_DEEP`) before anything recurses into it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tito.errors import InvalidArgument

#: Deepest nesting of a JSON text a request may carry (each object or array one level). Far
#: beyond any real tool call or schema, and derender's tool-call lexer stops at the same depth.
MAX_JSON_DEPTH = 64

#: The contract's reason for a JSON text nested past MAX_JSON_DEPTH.
JSON_TOO_DEEP = "JSON_TOO_DEEP"

#: Deepest nesting of a google.protobuf.Struct a request may carry (tool parameters,
#: arguments_object, chat_template_kwargs, processor_kwargs): the Struct itself is level 1, each
#: struct or list value inside it one more. Far more than any real schema needs, and low enough
#: that a Struct still parses where protobuf's decoder reads it again (it stops at 100 message
#: levels; a Struct level costs three of them). Render refuses deeper Structs, and the gateway
#: refuses deeper JSON before it converts it to one.
MAX_STRUCT_DEPTH = 32

# A JSON string (escapes included), or a bracket outside one. An unterminated string runs to the
# end of the text: what is inside it is not nesting.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\Z)|[\[\]{}]', re.DOTALL)


def json_depth(text: str) -> int:
    """The deepest container nesting in `text` (0 for a scalar), read as JSON would be without
    parsing it. Text that is not JSON gets some number; the parser that reads it next says why
    it is not JSON."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif token in "]}":
            depth -= 1
    return deepest


def check_json_depth(text: str, field: str) -> None:
    """Refuse `text` (the request's `field`) when it nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InvalidArgument(f"{field} nests {depth} JSON containers deep: at most {MAX_JSON_DEPTH}",
                              reason=JSON_TOO_DEEP, field=field,
                              metadata={"limit": "max_json_depth", "max": str(MAX_JSON_DEPTH)})


def loads_bounded(text: str, field: str) -> Any:
    """`json.loads(text)` after `check_json_depth`: a ValueError for text that is not JSON, an
    InvalidArgument JSON_TOO_DEEP for text nested too deep, never a RecursionError."""
    check_json_depth(text, field)
    return json.loads(text)
