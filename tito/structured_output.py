"""The structured-output constraint of the contract (`tito.v1.StructuredOutput`) as plain data, and
the check every service applies to it.

Render checks what it builds from `response_format` and tools, the engine checks what it receives
(both backends), with the same code, so a constraint that passes one passes the other and an
invalid one is refused before any request is queued: INVALID_ARGUMENT, reason
INVALID_STRUCTURED_OUTPUT, the field, and the grammar compiler's own message.

The grammar is xgrammar's (imported lazily: only constrained requests pay for it). Building it
needs no tokenizer, so checking is cheap; the engine compiles it against its vocabulary later
(services/engine/tito_engine/model/constraints.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from tito.errors import InvalidArgument
from tito.json_text import check_json_depth

INVALID_STRUCTURED_OUTPUT = "INVALID_STRUCTURED_OUTPUT"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One constraint as plain data (picklable). `value` is the schema / regex / grammar / tag
    text; for "choice" the JSON list of the strings; for "json_object" empty."""

    kind: str
    value: str = ""

    @property
    def key(self) -> str:
        """A hash of the constraint: same constraint, same compiled grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()

    @property
    def field(self) -> str:
        return f"sampling_params.structured_output.{self.kind}"

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "StructuredOutputSpec":
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


def spec_from_proto(constraint: Any) -> StructuredOutputSpec | None:
    """A `tito.v1.StructuredOutput` as a spec (None when no kind is set)."""
    kind = constraint.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutputSpec.choice(constraint.choice.choices)
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    return StructuredOutputSpec(kind, getattr(constraint, kind))


def grammar_of(spec: StructuredOutputSpec) -> Any:
    """The tokenizer-independent xgrammar Grammar of `spec` (raises on a bad constraint)."""
    import xgrammar

    if spec.kind in ("json_schema", "json_object"):
        schema = spec.value if spec.kind == "json_schema" else _JSON_OBJECT_SCHEMA
        return _json_control_chars_escaped(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
    if spec.kind == "grammar":
        return xgrammar.Grammar.from_ebnf(spec.value)
    if spec.kind == "structural_tag":
        return _json_control_chars_escaped(xgrammar.Grammar.from_structural_tag(spec.value))
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


# xgrammar 0.2.8 writes a length-bounded JSON string's characters (minLength/maxLength) as
# [^"\\\r\n], which lets raw control characters (U+0000-U+001F) into the string: invalid JSON
# (RFC 8259 wants them escaped). Its unbounded strings exclude them; so do ours.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_control_chars_escaped(grammar: Any) -> Any:
    import xgrammar

    ebnf = str(grammar)
    if _BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\" \\ \n \t \uXXXX) are EBNF string escapes too.
    return json.dumps(text, ensure_ascii=True)


# Keys of recently accepted constraints: a client that sends one schema with every request
# (the usual case) has it built once, not once per request (0.3-0.4 ms for a typical schema).
_ACCEPTED: OrderedDict[str, None] = OrderedDict()
_ACCEPTED_MAX = 256


def validate(spec: StructuredOutputSpec, field: str | None = None) -> None:
    """Refuse a constraint that cannot compile, naming `field` (default: the engine's field of
    the kind) and quoting the compiler."""
    key = spec.key
    if key in _ACCEPTED:
        return
    _check(spec, field or spec.field)
    _ACCEPTED[key] = None
    while len(_ACCEPTED) > _ACCEPTED_MAX:
        _ACCEPTED.popitem(last=False)


def _check(spec: StructuredOutputSpec, field: str) -> None:
    if spec.kind in ("json_schema", "structural_tag"):
        check_json_depth(spec.value, field)  # before anything parses (and recurses into) it
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices:
            raise InvalidArgument("a choice constraint needs at least one string", reason=INVALID_STRUCTURED_OUTPUT,
                                  field=f"{field}.choices")
        for position, choice in enumerate(choices):
            if not choice:
                raise InvalidArgument("a choice must be a non-empty string", reason=INVALID_STRUCTURED_OUTPUT,
                                      field=f"{field}.choices[{position}]")
    elif spec.kind != "json_object" and not spec.value:
        raise InvalidArgument(f"the {spec.kind} constraint is empty", reason=INVALID_STRUCTURED_OUTPUT, field=field)
    try:
        grammar_of(spec)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses for bad input
        raise InvalidArgument(f"invalid {spec.kind} constraint: {compiler_message(exc)}",
                              reason=INVALID_STRUCTURED_OUTPUT, field=field) from None


def compiler_message(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ source line)."""
    text = str(exc).strip()
    return _XGRAMMAR_LOG_PREFIX.sub("", text).strip() or type(exc).__name__
