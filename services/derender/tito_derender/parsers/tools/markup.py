"""Shared machinery of the parsers whose calls are framed by markers (deepseek_v3, kimi_k2,
qwen3_coder, glm45, gpt_oss): a state machine over the content text, and the two ways such a
format writes a call's arguments.

- `MarkupToolParser`: each state handler reads from the front of the pending text and returns
  the rest, or WAIT when it cannot decide until more text arrives (the text is then held). The
  markup of a call whose name is not out yet is kept (`_raw`), so a call that breaks before that
  goes back to content as the text it was (see base.py for the rules every parser follows).
- `ObjectArguments`: a call whose arguments are one JSON object written after the name (the
  DeepSeek, Kimi and harmony formats). The object streams as the model writes it, validated by
  the JsonLexer; the call's first delta goes out with the object's "{".
- `KeyValueArguments`: a call whose arguments are written key by key as text (the Qwen3-Coder and
  GLM XML formats). Each value is typed by the tool's JSON schema (`typed_value`) and streamed as
  one JSON member once complete: `{"k": v`, then `, "k2": v2`, then `}`.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from tito_derender.parsers.markers import partial_marker_length
from tito_derender.parsers.tools.base import DONE, FAILED, PENDING, Event, ToolParser, is_utf8
from tito_derender.parsers.tools.json_scan import JsonLexer

#: Returned by a state handler that needs more text before it can go on.
WAIT = None
#: Longest header (a call's name or id) read before deciding the markup is not a call.
MAX_HEADER_CHARS = 512


def immediate(state):
    """Mark a state handler that runs as soon as it is entered (it acts on the marker that led
    to it, e.g. closing a call), even when no text follows yet."""
    state.immediate = True
    return state


class MarkupToolParser(ToolParser):
    """Base of the marker-framed parsers. Subclasses set `self._state` to handler methods."""

    def __init__(self, *, tools: Mapping[str, Any] | None = None, **options) -> None:
        super().__init__(**options)
        self.tools = tools or {}
        self._held = ""
        self._raw = ""  # markup consumed for the current call while its name is not out
        self._call: ObjectArguments | KeyValueArguments | None = None
        self._closing = False  # after a complete call, before the next one begins
        self._parts: list[str] = []  # a value gathered so far (see _scan_value)
        self._pending = ""  # the value's text from a possible closing marker on (see _scan_value)
        self._calls_before_section = 0  # calls made before the open section (see _between_calls)
        self._state: Callable[[str], str | None] = self._content_state

    # -- the parser's interface
    def feed(self, text: str) -> list[Event]:
        text = self._held + text
        self._held = ""
        while text:
            rest = self._state(text)
            if rest is WAIT:
                self._held = text
                break
            text = rest
        return self._take_events()

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._state == self._content_state:
            self._content(held)
        elif self._call is None and self._closing:
            if held.strip():  # text after a complete call that never became markup
                self._content(held)
            self._state = self._content_state
        else:
            self._content(self._give_up(held))
        self._closing = False
        return self._take_events()

    # -- for subclasses
    def _content_state(self, text: str) -> str | None:
        raise NotImplementedError

    def _consume(self, text: str, count: int) -> str:
        """Take `count` characters of markup from the front of `text`. Markup that closes a
        complete call is not kept: it never goes back to content."""
        if not self._closing:
            self._raw += text[:count]
        return text[count:]

    def _open(self, text: str, marker: str, state) -> str:
        """Content up to `marker`; from there on the markup is read by `state`."""
        return self._open_first(text, {marker: state})

    def _open_first(self, text: str, states: Mapping[str, Callable[[str], str | None]]) -> str:
        """Content up to the first of the markers `states` maps; from there on the markup is
        read by its state (what may be the start of one is held)."""
        found = [(position, marker) for marker in states if (position := text.find(marker)) >= 0]
        if not found:
            keep = max(partial_marker_length(text, marker) for marker in states)
            self._content(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return ""
        position, marker = min(found)
        self._content(text[:position])
        self._raw, self._call, self._closing, self._state = marker, None, False, states[marker]
        self._calls_before_section = self.calls_made
        return text[position + len(marker):]

    def _expect(self, text: str, choices: dict, opening: tuple[str, ...] = (), otherwise=None):
        """After optional whitespace, one of the literal `choices`: consume it and go to its
        state (a literal in `opening` begins a new call: its markup is kept from there). WAIT
        while the text may still become one; when it cannot, `otherwise(text)` (by default give
        up: content)."""
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        for literal, state in choices.items():
            if stripped.startswith(literal):
                stripped_count = len(text) - len(stripped)
                if literal in opening and self._closing:  # the next call: keep its markup
                    self._raw, self._closing, text, stripped_count = "", False, stripped, 0
                self._state = state
                rest = self._consume(text, stripped_count + len(literal))
                return state(rest) if getattr(state, "immediate", False) else rest
        if any(literal.startswith(stripped) for literal in choices):
            return WAIT
        return (otherwise or self._give_up)(text)

    @staticmethod
    def _until(text: str, *markers: str) -> tuple[str, str, str] | None:
        """(before, marker, after) for the first of `markers` in `text`, None when none is."""
        found = [(text.find(marker), marker) for marker in markers if marker in text]
        if not found:
            return None
        position, marker = min(found)
        return text[:position], marker, text[position + len(marker):]

    def _header(self, text: str, *markers: str):
        """`_until` for a short header: None (wait) until a marker shows; False when too much
        text came without one (not a call)."""
        split = self._until(text, *markers)
        if split is None and len(text) > MAX_HEADER_CHARS:
            return False
        return split

    def _reject(self, text: str, end: str, state) -> str:
        """A call to a function the request does not accept (tool_choice names another): its
        markup up to and including `end` is content; then read on in `state`."""
        self._state = lambda rest: self._skip_call(rest, end, state)
        return text

    def _break_call(self, text: str, end: str, state) -> str:
        """A call inside a section (DeepSeek's, Kimi's) breaks (an id or header that is none,
        arguments that are no JSON object): its markup up to and including `end` is content (a
        call already out has its arguments closed first), then the section is read on in `state`,
        so the calls after it are still calls."""
        call, raw = self._call, self._raw
        if call is not None:
            raw = call.fail(raw)
        self._call, self._raw, self._parts, self._pending = None, raw, [], ""
        return self._reject(text, end, state)

    def _between_calls(self, text: str, call_begin: str, call_state, section_end: str) -> str | None:
        """In a section, before a call: the next call (`call_begin`, read by `call_state`) or the
        section's end. Other text there is content, and the section is read on (vLLM drops it).
        A section that made no call was no call markup: its end is content too, so all its text
        is (as it is for any markup that is no call)."""
        stripped = text.lstrip()
        if stripped.startswith(call_begin):
            return self._expect(text, {call_begin: call_state}, opening=(call_begin,))
        if stripped.startswith(section_end):
            end = len(text) - len(stripped) + len(section_end)
            if self.calls_made == self._calls_before_section:
                self._content(("" if self._closing else self._raw) + text[:end])
            self._raw, self._state = "", self._content_state
            return text[end:]
        if not stripped or call_begin.startswith(stripped) or section_end.startswith(stripped):
            return WAIT
        found = [position for marker in (call_begin, section_end) if (position := text.find(marker)) >= 0]
        cut = min(found) if found else \
            len(text) - max(partial_marker_length(text, marker) for marker in (call_begin, section_end))
        self._content(("" if self._closing else self._raw) + text[:cut])
        self._raw = ""
        if found:
            return text[cut:]
        self._held = text[cut:]
        return ""

    def _skip_call(self, text: str, end: str, state) -> str | None:
        position = text.find(end)
        if position < 0:  # content as it comes, but for what may be the start of `end`
            keep = partial_marker_length(text, end)
            self._content(self._raw + text[:len(text) - keep])
            self._raw, self._held = "", text[len(text) - keep:]
            return ""
        self._content(self._raw + text[:position + len(end)])
        self._raw, self._closing, self._state = "", True, state
        return text[position + len(end):]

    def _scan_value(self, text: str, closers: Mapping[str, tuple[str, ...]],
                    openers: Collection[str] = ()) -> tuple[str, str, str] | None:
        """A value that may itself hold markup (code, XML, HTML a tool writes to a file), gathered
        over any number of feeds. It ends at a closing marker (a key of `closers`) only where,
        after optional whitespace, one of that marker's followers comes next (`</parameter>` then
        `<parameter=` or `</function>`): a closing marker followed by anything else is part of
        the value. It also ends where one of `openers` begins (the start of the next argument,
        `<parameter=city>`, written by a model that dropped the closing marker). Returns (value,
        the closing marker or opener, the text to read next: from the follower on, or after the
        opener), or None when the end has not come yet; all of `text` is taken then (a possible
        end is kept in `_pending`, at most a marker, whitespace and a follower long), so each
        character is scanned a bounded number of times. Text known to be the value's goes to
        `_value_text` as it is found."""
        buffer = self._pending + text
        self._pending = ""
        self._consume(text, len(text))
        markers = (*closers, *openers)
        position = 0
        while True:
            found = [(index, marker) for marker in markers if (index := buffer.find(marker, position)) >= 0]
            if not found:
                keep = max(partial_marker_length(buffer[position:], marker) for marker in markers)
                self._value_text(buffer[position:len(buffer) - keep])
                self._pending = buffer[len(buffer) - keep:]
                return None
            index, marker = min(found)
            after = buffer[index + len(marker):]
            if marker in openers:
                return self._value_end(buffer[position:index], marker, after)
            stripped = after.lstrip()
            followers = closers[marker]
            if any(stripped.startswith(follower) for follower in followers):
                return self._value_end(buffer[position:index], marker, stripped)
            maybe = not stripped or any(f.startswith(stripped) for f in followers)
            if maybe and len(after) - len(stripped) <= MAX_HEADER_CHARS:
                self._value_text(buffer[position:index])
                self._pending = buffer[index:]  # wait: whitespace, or the start of a follower
                return None
            self._value_text(buffer[position:index + 1])  # part of the value: look further on
            position = index + 1

    def _value_text(self, text: str) -> None:
        """Text `_scan_value` found to be part of the value: kept, and passed to the call, which
        streams a string value as it comes (KeyValueArguments.extend)."""
        if text:
            self._parts.append(text)
            if isinstance(self._call, KeyValueArguments):
                self._call.extend(text)

    def _value_end(self, last: str, marker: str, rest: str) -> tuple[str, str, str]:
        value = "".join(self._parts) + last
        self._parts = []
        if not self._closing and rest:
            self._raw = self._raw[:len(self._raw) - len(rest)]  # read again by the next state
        return value, marker, rest

    def _done(self) -> None:
        """The current call is complete: what follows up to the next call is closing markup."""
        self._call, self._raw, self._closing = None, "", True

    def _feed_object(self, text: str, after: Callable[[str], str | None], broken=None) -> str | None:
        """Feed the call's JSON-object arguments; once the object is complete, the parser goes on
        in state `after` (the format's closing markup). Broken arguments give the call up (or
        call `broken(rest)`)."""
        consumed = self._call.feed(text)
        if self._call.status == DONE:
            self._done()
            self._state = after
        text = text[consumed:]
        if self._call is not None and self._call.status == FAILED:
            return (broken or self._give_up)(text)
        return text

    def _give_up(self, text: str) -> str:
        """The markup is not (or no longer) a call: what was consumed goes back to content (or,
        if the call is already out, its arguments are closed) and `text` is read as content."""
        call, raw = self._call, self._raw
        if call is not None:
            raw = call.fail(raw)
        elif self._closing:
            raw = ""
        self._call, self._raw, self._closing, self._state = None, "", False, self._content_state
        self._parts, self._pending = [], ""
        self._content(raw)
        return text

    def parameter_schema(self, function: str, key: str) -> tuple[Any, Any]:
        """(the JSON schema of argument `key` of `function`, the function's whole parameters
        schema, where its `$ref`s point): None for what the tools do not say."""
        parameters = self.tools.get(function) or {}
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        return (properties.get(key) if isinstance(properties, dict) else None), parameters

    def property_names(self, function: str) -> tuple[str, ...]:
        """The argument names the schema of `function` declares (none for a tool without one)."""
        parameters = self.tools.get(function)
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        return tuple(key for key in properties if isinstance(key, str)) if isinstance(properties, dict) else ()


class ObjectArguments:
    """One call whose arguments are a bare JSON object (see the module docstring)."""

    def __init__(self, parser: ToolParser, name: str, call_id: str = "") -> None:
        self._parser = parser
        self._name = name
        self._call_id = call_id
        self._lexer = JsonLexer(object_only=True)
        self._kept: list[str] = []  # the object text, kept while the call is not out
        self.index: int | None = None
        self.status = PENDING

    @property
    def name_sent(self) -> bool:
        return self.index is not None

    def feed(self, text: str) -> int:
        """Consume object text; returns how much was consumed. Sets `status`."""
        consumed = self._lexer.feed(text)
        piece = text[:consumed]
        if not self._parser.streaming:
            self._kept.append(piece)
        elif piece:  # valid JSON so far: the call is out from its "{" on
            if not self.name_sent:
                self.index = self._parser._start_call(self._name, self._call_id)
            self._parser._arguments(self.index, piece)
        if self._lexer.error:
            self.status = FAILED
        elif self._lexer.done:
            if not self.name_sent:
                self.index = self._parser._start_call(self._name, self._call_id)
                self._parser._arguments(self.index, "".join(self._kept))
            self._kept = []
            self.status = DONE
        return consumed

    def fail(self, raw: str) -> str:
        """End a broken call: close its arguments if it is out (returns ""), else return the
        markup `raw` and the object text for content."""
        self.status = FAILED
        if not self.name_sent:
            return raw + "".join(self._kept)
        completion = self._lexer.completion(0) if not self._lexer.done else ""
        self._parser._arguments(self.index, completion)
        return ""


class KeyValueArguments:
    """One call whose arguments come as (key, text value) pairs (see the module docstring)."""

    def __init__(self, parser: MarkupToolParser, name: str, unknown: str) -> None:
        self._parser = parser
        self._name = name
        self._unknown = unknown
        self._members: list[str] = []  # JSON members, kept while the call is not out
        self.keys: set[str] = set()  # the argument names given so far
        self._value: StringValueStream | None = None  # the string value streaming now
        self._braced = False  # the arguments' "{" is out
        self.index: int | None = None
        self.status = PENDING
        if parser.streaming:
            self.index = parser._start_call(name)

    @property
    def name_sent(self) -> bool:
        return self.index is not None

    def begin_value(self, key: str, *, trim_newline: bool = False, stop_at: str = "") -> None:
        """The value of `key` begins. Streamed, a value the schema makes a plain string (string
        types only; a key it does not name, where such keys are strings) goes out as its text is
        found (`extend`), not once it is complete, so a long file a tool writes shows as it is
        written: `"key": "` now, the text as it comes, the rest and `"` at `add`.
        `trim_newline` and `stop_at` say what `StringValueStream` holds back."""
        key = key.strip()
        self._value = None
        if not self.name_sent or not is_utf8(key) or not self._plain_string(key):
            return
        self._value = StringValueStream(key, trim_newline, stop_at)
        self._send(json.dumps(key, ensure_ascii=False) + ': "', member=True)

    def extend(self, text: str) -> None:
        """More text of the value begun last (see begin_value)."""
        if self._value is None:
            return
        if not is_utf8(text):  # no JSON string carries it: `add` will find the call malformed
            self._value.stop()
            return
        ready = self._value.take(text)
        if ready:
            self._send(_json_string_body(ready))

    def _plain_string(self, key: str) -> bool:
        schema, root = self._parser.parameter_schema(self._name, key)
        kinds = schema_types(schema, root)
        return all(kind in _STRING_TYPES for kind in kinds) if kinds else self._unknown == "string"

    def add(self, key: str, raw_value: str) -> bool:
        """Add one argument; False (the call is malformed) for a key or value JSON cannot carry."""
        streamed = self._value if self._value is not None and self._value.key == key else None
        schema, root = self._parser.parameter_schema(self._name, key)
        value = typed_value(raw_value, schema, self._unknown, root)
        if not is_utf8(key) or (isinstance(value, str) and not is_utf8(value)):
            return False
        member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        if streamed is not None:  # its text went out as it came: the rest, and the string's end
            self._value = None
            self._send(_json_string_body(raw_value[streamed.sent:]) + '"')
        elif self.name_sent:
            self._send(member, member=True)
        self._members.append(member)
        self.keys.add(key)
        return True

    def _send(self, fragment: str, member: bool = False) -> None:
        """Stream an arguments fragment; `member`: it begins a member (after "{" or ", ")."""
        if member:
            fragment = (", " if self._braced else "{") + fragment
            self._braced = True
        self._parser._arguments(self.index, fragment)

    def close(self) -> None:
        if not self.name_sent:
            self.index = self._parser._start_call(self._name)
            self._parser._arguments(self.index, "{" + ", ".join(self._members) + "}")
        else:
            if self._value is not None:  # a string value cut off while it streamed: end its string
                self._value = None
                self._send('"')
            self._send("}" if self._braced else "{}")
        self.status = DONE

    def fail(self, raw: str) -> str:
        """End a broken call: close it if it is out (returns ""), else return `raw`."""
        if not self.name_sent:
            self.status = FAILED
            return raw
        self.close()
        return ""


class StringValueStream:
    """Which text of a string value that streams (KeyValueArguments.begin_value) can go out now.
    Held back: with `trim_newline`, a leading newline and, until more text follows, a trailing
    one (the newline the template writes on each side of a Qwen3-Coder value is not part of it);
    from `stop_at` on (`<parameter=`), everything until the value ends, since the parser may yet
    split the value there (Qwen3CoderToolParser._add_values); and what may be its start."""

    def __init__(self, key: str, trim_newline: bool, stop_at: str) -> None:
        self.key = key
        self.sent = 0  # characters of the value sent
        self._trim_newline = trim_newline
        self._stop_at = stop_at
        self._held = ""
        self._started = False
        self._stopped = False

    def stop(self) -> None:
        """Send nothing more until the value ends."""
        self._stopped = True

    def take(self, text: str) -> str:
        """Of what is held and `text` (the value's next text), the part that can be sent now."""
        if self._stopped:
            return ""
        text = self._held + text
        if not self._started and text:
            self._started = True
            if self._trim_newline and text.startswith("\n"):
                text = text[1:]
        keep = 0
        if self._stop_at:
            position = text.find(self._stop_at)
            if position >= 0:
                self._stopped = True
                keep = len(text) - position
            else:
                keep = partial_marker_length(text, self._stop_at)
        ready = text[:len(text) - keep]
        if self._trim_newline and ready.endswith("\n"):
            ready = ready[:-1]
        self._held = text[len(ready):]
        self.sent += len(ready)
        return ready


def _json_string_body(text: str) -> str:
    """`text` as it stands inside a JSON string (escaped, without the quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_TYPES = {"integer", "int", "uint", "long", "short"}
_NUMBER_TYPES = {"number", "float", "double"}
_BOOLEAN_TYPES = {"boolean", "bool"}
_NULL_WORDS = ("null", "none")
#: How deep `schema_types` follows anyOf / oneOf / allOf / $ref (a schema may refer to itself).
_MAX_SCHEMA_HOPS = 8
_JSON_KINDS = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"),
               (list, "array"), (type(None), "null"))


def schema_types(schema: Any, root: Any = None, hops: int = 0) -> list[str]:
    """The JSON types a property's schema allows, in the order it names them, lower case: its
    `type` (a name or a list), the types of its `anyOf` / `oneOf` / `allOf` branches, of a local
    `$ref` (`#/$defs/X`, `#/definitions/X`, resolved in `root`), "null" for OpenAPI's
    `nullable: true`, and, where nothing names a type, those of its `enum` / `const` values.
    What Pydantic writes for `Optional[int]`, `int | str` or `dict | None` is all here."""
    if isinstance(schema, (str, list)):  # a bare type, as older callers pass it
        schema = {"type": schema}
    if not isinstance(schema, dict) or hops > _MAX_SCHEMA_HOPS:
        return []
    found: list[str] = []

    def add(kinds) -> None:
        for kind in kinds:
            if isinstance(kind, str) and kind.lower() not in found:
                found.append(kind.lower())

    declared = schema.get("type")
    add([declared] if isinstance(declared, str) else declared if isinstance(declared, list) else [])
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                add(schema_types(branch, root, hops + 1))
    reference = schema.get("$ref")
    if isinstance(reference, str) and isinstance(root, dict):
        target: Any = root
        for part in reference.removeprefix("#/").split("/") if reference.startswith("#/") else [None]:
            target = target.get(part) if isinstance(target, dict) and part is not None else None
        add(schema_types(target, root, hops + 1))
    if schema.get("nullable") is True:
        add(["null"])
    if not found:
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if "const" in schema else [])
        add([next((kind for cls, kind in _JSON_KINDS if type(value) is cls), "string") for value in values])
    return found


def typed_value(raw: str, schema: Any, unknown: str = "string", root: Any = None) -> Any:
    """An argument written as text, as the JSON value its schema asks for (`schema`: the
    property's schema, or a bare type name or list; `root`: the function's parameters schema,
    for `$ref`). By the types `schema_types` finds:
    - null (`null` or Python's `None`) when the types allow null, or name no string;
    - else the first other type the text parses as, string last: integers, numbers, booleans
      (Python's True/False too: that is how a Jinja template prints them), objects and arrays
      (JSON, or a Python literal); so `int | str` reads "42" as 42 and "abc" as "abc";
    - a value that parses as none of them stays the raw text.
    `unknown`: what a key with no type gets: "string", or "json" (parsed as JSON when it is
    JSON, else a string)."""
    kinds = schema_types(schema, root)
    if not kinds:
        return _json_or_string(raw) if unknown == "json" else raw
    text = raw.strip()
    others = [kind for kind in kinds if kind != "null" and kind not in _STRING_TYPES]
    has_string = len(others) + ("null" in kinds) < len(kinds)
    if text.lower() in _NULL_WORDS and ("null" in kinds or not has_string):
        return None
    for kind in others:
        value = _parse_as(kind, text, lenient=len(others) == 1 and not has_string)
        if value is not _NO_VALUE:
            return value
    return raw


_NO_VALUE = object()


def _parse_as(kind: str, text: str, lenient: bool) -> Any:
    """`text` as a value of JSON type `kind`, or _NO_VALUE. `lenient`: the only type the schema
    allows, so an object or array type takes any JSON (or literal) value the text holds."""
    if kind in _INTEGER_TYPES or kind.startswith("int"):
        try:
            return int(text)
        except ValueError:
            return _NO_VALUE
    if kind in _NUMBER_TYPES:
        try:
            number = float(text)
        except ValueError:
            return _NO_VALUE
        if number != number or number in (float("inf"), float("-inf")):
            return _NO_VALUE
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    if kind in _BOOLEAN_TYPES:
        lowered = text.lower()
        return True if lowered == "true" else False if lowered == "false" else _NO_VALUE
    parsed = _json_or_string(text)
    if parsed is text:
        try:
            parsed = json.loads(json.dumps(ast.literal_eval(text)))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _NO_VALUE
    if lenient or (kind == "object" and isinstance(parsed, dict)) or (kind == "array" and isinstance(parsed, list)):
        return parsed
    return _NO_VALUE


def _json_or_string(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
