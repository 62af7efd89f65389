"""An incremental, validating JSON lexer for one value arriving in pieces.

Tool-call parsers stream a call's arguments as the model writes them. To do that without
re-parsing the whole call on every token they need to know, character by character, whether the
text so far is still a valid JSON prefix, where each top-level member's value starts and ends,
and (when the model breaks off) how to close what is open. This lexer gives exactly that:

- `feed(text)` consumes characters until the value is complete or a character makes it
  invalid (that character is not consumed); work is O(len(text)), runs of string characters
  are skipped with one regex match.
- members of a top-level object are tracked: `members[key] = (start, end)` offsets once a
  member's value is complete, `open_key` / `open_start` while it is being written; string
  values of top-level members are kept (`strings[key]`, raw with quotes) for names.
- `completion(depth)` is the shortest text that turns what was consumed into valid JSON for
  every container deeper than `depth` (closing strings, finishing a number or literal,
  supplying a missing value), used to end a call's argument stream cleanly.
- nesting is bounded (`MAX_DEPTH` open containers): a value nested deeper is invalid at the
  container that goes too deep, like any other bad character. Model output is not a caller's
  mistake, but arguments thousands of levels deep are not a usable tool call either (Python's
  json and protobuf's Struct give up long before), so the parsers treat them as malformed markup.
"""

from __future__ import annotations

import json
import re

_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON, _COMMA_OR_END, _STRING, _NUMBER, _LITERAL, _DONE = range(10)
_WHITESPACE = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
#: Most containers a value may have open at once (see the module docstring).
MAX_DEPTH = 64

# Number DFA: state -> {character class -> next state}; complete states can end a number.
_DIGITS = "0123456789"
_NUMBER_COMPLETE = {"zero", "int", "frac", "exp_digits"}


def _number_step(state: str, char: str) -> str | None:
    digit = char in _DIGITS
    if state == "start":
        return "minus" if char == "-" else "zero" if char == "0" else "int" if digit else None
    if state == "minus":
        return "zero" if char == "0" else "int" if digit else None
    if state in ("zero", "int"):
        if digit:
            return "int" if state == "int" else None
        return "dot" if char == "." else "exp" if char in "eE" else None
    if state in ("dot", "frac"):
        if digit:
            return "frac"
        return "exp" if state == "frac" and char in "eE" else None
    if state == "exp":
        return "exp_sign" if char in "+-" else "exp_digits" if digit else None
    if state in ("exp_sign", "exp_digits"):
        return "exp_digits" if digit else None
    return None


class JsonLexer:
    """State of one JSON value being read; see the module docstring."""

    def __init__(self, object_only: bool = False, max_depth: int = MAX_DEPTH) -> None:
        self._object_only = object_only
        self._max_depth = max_depth
        self.length = 0  # characters consumed
        self.stack: list[str] = []  # open containers, "{" or "["
        self.state = _VALUE
        self.error = False
        self._after_comma = False  # in _VALUE: whether a comma (or colon) asked for this value
        self._key = False  # the current string is an object key
        self._escape = 0  # -1 after a backslash, n > 0 hex digits still expected after \u
        self._number = ""
        self._literal = ""
        self._literal_at = 0
        self._capture: list[str] | None = None  # raw text of a top-level member's key or string
        self.open_key: str | None = None  # top-level member whose value is expected or open
        self.open_start: int | None = None
        self.first_char = ""  # first character of the open member's value
        self.members: dict[str, tuple[int, int]] = {}
        self.member_first: dict[str, str] = {}
        self.strings: dict[str, str] = {}

    @property
    def done(self) -> bool:
        return self.state == _DONE

    @property
    def started(self) -> bool:
        return self.length > 0 and bool(self.stack or self.state != _VALUE)

    def _top_level_member(self) -> bool:
        return len(self.stack) == 1 and self.stack[0] == "{"

    def feed(self, text: str) -> int:
        """Consume characters of `text`; return how many (fewer than all on completion or error)."""
        i, n, base = 0, len(text), self.length
        while i < n and self.state != _DONE and not self.error:
            state = self.state
            char = text[i]
            if state == _STRING:
                if self._escape:
                    if self._escape == -1:
                        if char == "u":
                            self._escape = 4
                        elif char in '"\\/bfnrt':
                            self._escape = 0
                        else:
                            self.error = True
                            break
                    elif char in _HEX:
                        self._escape -= 1
                    else:
                        self.error = True
                        break
                    if self._capture is not None:
                        self._capture.append(char)
                    i += 1
                    continue
                match = _STRING_RUN.match(text, i)
                if match:
                    if self._capture is not None:
                        self._capture.append(match.group())
                    i = match.end()
                    continue
                if char == '"':
                    i += 1
                    self._end_string(base + i)
                elif char == "\\":
                    self._escape = -1
                    if self._capture is not None:
                        self._capture.append(char)
                    i += 1
                else:
                    self.error = True  # a raw control character
                continue
            if state == _NUMBER:
                step = _number_step(self._number, char)
                if step is None:
                    if self._number in _NUMBER_COMPLETE:
                        self._value_done(base + i)  # the number ended; look at char again
                    else:
                        self.error = True
                    continue
                self._number = step
                i += 1
                continue
            if state == _LITERAL:
                if char != self._literal[self._literal_at]:
                    self.error = True
                    continue
                self._literal_at += 1
                i += 1
                if self._literal_at == len(self._literal):
                    self._value_done(base + i)
                continue
            if char in _WHITESPACE:
                i += 1
                continue
            if state == _VALUE or state == _VALUE_OR_END:
                if state == _VALUE_OR_END and char == "]":
                    i += 1
                    self._close(base + i)
                elif not self._begin_value(char, base + i):
                    self.error = True
                else:
                    i += 1
            elif state == _KEY or state == _KEY_OR_END:
                if char == '"':
                    self.state, self._key, self._escape = _STRING, True, 0
                    self._capture = [] if self._top_level_member() else None
                    i += 1
                elif char == "}" and state == _KEY_OR_END:
                    i += 1
                    self._close(base + i)
                else:
                    self.error = True
            elif state == _COLON:
                if char != ":":
                    self.error = True
                    continue
                self.state, self._after_comma = _VALUE, True
                i += 1
            else:  # _COMMA_OR_END
                top = self.stack[-1]
                if char == ",":
                    self.state = _KEY if top == "{" else _VALUE
                    self._after_comma = True
                    i += 1
                elif char == ("}" if top == "{" else "]"):
                    i += 1
                    self._close(base + i)
                else:
                    self.error = True
        self.length += i
        return i

    def _begin_value(self, char: str, position: int) -> bool:
        if not self.stack and self._object_only and char != "{":
            return False
        if char in "{[" and len(self.stack) >= self._max_depth:
            return False  # nested too deep: invalid here, like a bad character
        if self._top_level_member():
            self.open_start, self.first_char = position, char
        if char == "{":
            self.stack.append("{")
            self.state = _KEY_OR_END
        elif char == "[":
            self.stack.append("[")
            self.state = _VALUE_OR_END
        elif char == '"':
            self.state, self._key, self._escape = _STRING, False, 0
            self._capture = [] if self._top_level_member() else None
        elif char == "-" or char in _DIGITS:
            self.state, self._number = _NUMBER, _number_step("start", char)
        elif char in _LITERALS:
            self.state, self._literal, self._literal_at = _LITERAL, _LITERALS[char], 1
        else:
            return False
        return True

    def _end_string(self, end: int) -> None:
        captured = self._capture
        self._capture = None
        if self._key:
            if captured is not None:
                self.open_key = json.loads('"' + "".join(captured) + '"')
                self.open_start = None
            self.state = _COLON
            return
        if captured is not None and self.open_key is not None:
            self.strings[self.open_key] = '"' + "".join(captured) + '"'
        self._value_done(end)

    def _close(self, end: int) -> None:
        self.stack.pop()
        self._value_done(end)

    def _value_done(self, end: int) -> None:
        if not self.stack:
            self.state = _DONE
            return
        if self._top_level_member() and self.open_key is not None and self.open_start is not None:
            self.members[self.open_key] = (self.open_start, end)
            self.member_first[self.open_key] = self.first_char
            self.open_key = self.open_start = None
        self.state = _COMMA_OR_END

    def completion(self, depth: int) -> str:
        """Text that makes the consumed text valid JSON for the containers deeper than `depth`
        (stack[depth:]): e.g. '{"a": [1, "x' -> '"]}' at depth 0."""
        out = []
        state = self.state
        if state == _STRING:
            if self._escape == -1:
                out.append("\\")
            elif self._escape > 0:
                out.append("0" * self._escape)
            out.append('"')
            if self._key:
                out.append(": null")
        elif state == _NUMBER and self._number not in _NUMBER_COMPLETE:
            out.append("0")
        elif state == _LITERAL:
            out.append(self._literal[self._literal_at:])
        elif state == _VALUE and self._after_comma:
            out.append("null")
        elif state == _KEY:
            out.append('"": null')
        elif state == _COLON:
            out.append(": null")
        for container in reversed(self.stack[depth:]):
            out.append("}" if container == "{" else "]")
        return "".join(out)


def is_json_object(text: str) -> bool:
    """Whether `text` is exactly one JSON object (whitespace around it allowed), by the same
    rules as the streaming lexer: strict JSON (no NaN or Infinity) nested at most MAX_DEPTH deep.
    Never raises and never recurses, whatever the text."""
    lexer = JsonLexer(object_only=True)
    consumed = lexer.feed(text)
    return lexer.done and not text[consumed:].strip(_WHITESPACE)
