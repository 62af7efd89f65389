"""Pythonic tool calls: the output is a Python list of calls, `[f(a=1), g(b="x", c=[1, 2])]`,
keyword arguments with Python literal values (Llama 3.2 / 4 style).

As in vLLM the list must start the output (after whitespace); otherwise the output is plain
content. The list is read item by item: an item ends at the "," or "]" that follows it outside
any string or bracket, and only then is it checked. A valid call (a name, keyword arguments only,
each value a Python literal that JSON can carry, nested at most MAX_DEPTH containers deep as for
the JSON parsers) is sent whole, its arguments as one JSON object. So a call is never sent
before it is known to be valid, and nothing is ever invented for a broken one.

A malformed item (a positional argument, a nested call, a set, an unbalanced bracket, anything
not a call) is content: its own text, as written. The calls beside it are still calls. A list in
which no item is a valid call is not a call list: all of its text is content, untouched. A list
cut off before its "]" keeps the calls it completed; its unfinished item is content.
"""

from __future__ import annotations

import ast
import json
import re

from tito_derender.parsers.tools.base import Event, ToolParser, is_utf8
from tito_derender.parsers.tools.json_scan import MAX_DEPTH

_START, _ITEM, _CONTENT = range(3)
_PLAIN_RUN = re.compile(r"""[^'"\\()\[\]{},]+""")
_OPENERS, _CLOSERS = "([{", ")]}"
# The call's own parentheses are one level; its values may nest MAX_DEPTH - 2 containers, so the
# arguments JSON is at most as deep as the JSON parsers allow (their call and arguments objects).
_MAX_ITEM_DEPTH = MAX_DEPTH - 1


class _Malformed(Exception):
    pass


class PythonicToolParser(ToolParser):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._mode = _START
        self._raw: list[str] = []  # all the list's text: its content if no item is a call
        self._held_items: list[str] = []  # malformed items' text: content when the list ends
        self._item: list[str] = []  # the current item's text
        self._depth = 0
        self._too_deep = False  # the item nests deeper than allowed: malformed, but read to its end
        self._unbalanced = False
        self._quote = ""  # inside a string literal: its quote character
        self._escape = False

    def feed(self, text: str) -> list[Event]:
        position = 0
        while position < len(text):
            if self._mode == _CONTENT:
                self._content(text[position:])
                break
            if self._mode == _START:
                position = self._start(text, position)
            else:
                position = self._scan_item(text, position)
        return self._take_events()

    def _start(self, text: str, position: int) -> int:
        """Before the list: whitespace, then "[" (else everything is content)."""
        char = text[position]
        if char.isspace():
            self._raw.append(char)
            return position + 1
        if char != "[":
            self._to_content()
            return position
        self._raw.append(char)
        self._mode = _ITEM
        return position + 1

    def _scan_item(self, text: str, position: int) -> int:
        """Read the current item up to the "," or "]" that ends it at depth 0."""
        start = position
        while position < len(text):
            char = text[position]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = ""
                position += 1
                continue
            plain = _PLAIN_RUN.match(text, position)
            if plain:
                position = plain.end()
                continue
            if char in "'\"":
                self._quote = char
            elif char in _OPENERS:
                self._depth += 1
                self._too_deep = self._too_deep or self._depth > _MAX_ITEM_DEPTH
            elif char in _CLOSERS and self._depth:
                self._depth -= 1
            elif self._depth:  # a "," inside brackets
                pass
            elif char in ",]":  # at depth 0: the item ends here
                self._item.append(text[start:position])
                self._end_item(last=char == "]")
                self._raw.append(char)
                if char == "]":
                    self._end_list()
                return position + 1
            else:  # an unbalanced ")" or "}": the item is malformed; read on to its end
                self._unbalanced = True
            position += 1
        self._item.append(text[start:position])
        return position

    def _end_item(self, *, last: bool) -> None:
        """Check the item just read: send it as a call, or keep it as content."""
        item = "".join(self._item)
        self._raw.append(item)
        self._item, self._depth, self._quote, self._escape = [], 0, "", False
        malformed = self._too_deep or self._unbalanced
        self._too_deep = self._unbalanced = False
        if not item.strip() and last and self.calls_made:
            return  # "[f(), ]": a trailing comma is no item
        try:
            if malformed:
                raise _Malformed
            name, arguments = _parse_call(item.strip(), self.accept_name)
        except _Malformed:
            if item.strip():
                self.malformed_calls += 1
                self._held_items.append(item.strip())
            return
        self._arguments(self._start_call(name), arguments)

    def _end_list(self) -> None:
        """After the list: its malformed items are content (all of its text if no item was a
        call), and so is everything that follows."""
        if self.calls_made:
            self._content(" ".join(self._held_items))
            self._raw, self._held_items = [], []
            self._mode = _CONTENT
        else:
            self._to_content()

    def _to_content(self) -> None:
        """Not a call list: the text read so far is content, and so is the rest."""
        self._content("".join(self._raw))
        self._raw, self._held_items = [], []
        self._mode = _CONTENT

    def finish(self) -> list[Event]:
        if self._mode == _START:
            self._to_content()
        elif self._mode == _ITEM:
            unfinished = "".join(self._item)
            if self._quote or self._depth:  # cut off inside the item: it cannot be a call
                self._raw.append(unfinished)
                if unfinished.strip():
                    self._held_items.append(unfinished.strip())
                self._item = []
            elif unfinished.strip():
                self._end_item(last=True)  # a complete item without its "]"
            self._end_list()
        self._mode = _CONTENT
        return self._take_events()


def _parse_call(item: str, accept_name) -> tuple[str, str]:
    """(name, arguments JSON) of one item, or _Malformed."""
    try:
        node = ast.parse(item, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise _Malformed from None
    if not isinstance(node, ast.Call) or node.args:
        raise _Malformed
    name = _dotted_name(node.func)
    if not name or not accept_name(name):
        raise _Malformed
    members = []
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _Malformed
        members.append(f"{json.dumps(keyword.arg, ensure_ascii=False)}: {_literal_json(keyword.value)}")
    return name, "{" + ", ".join(members) + "}"


def _dotted_name(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _literal_json(node: ast.expr) -> str:
    try:
        value = ast.literal_eval(node)
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise _Malformed from None
    if not is_utf8(encoded):
        # A "\ud83c\udf89"-style escape: Python keeps surrogates apart, which no protobuf string
        # may carry; JSON escapes say the same thing and decode to the character.
        encoded = json.dumps(value, ensure_ascii=True, allow_nan=False)
    return encoded


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = PythonicToolParser
