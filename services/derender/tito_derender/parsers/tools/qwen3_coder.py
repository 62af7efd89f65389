"""Qwen3-Coder tool calls (XML):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A `<function=NAME>` without the `<tool_call>` before it is a call too (a model that dropped it).

Values are text, typed by the tool's JSON schema (see markup.typed_value: strings stay raw,
numbers / booleans / objects are parsed; a key the schema does not know stays a string). The
newline the template writes on each side of a value is not part of it.

A value may hold markup itself (code, XML, HTML a tool writes to a file, `<parameter=` or
`<tool_call>` text included): it ends only at a `</parameter>` followed, after whitespace, by
`<parameter=` or `</function>`; for a model that drops `</parameter>`, at a `<parameter=NAME>`
naming an argument of the tool not given yet, or at a `</function>` followed by `</tool_call>` (or
the end of the output). In a value that ended at `</function>` with no `</parameter>` at all, each
`<parameter=` starts the next parameter. Streamed, a string value goes out as its text comes;
other values one member per completed parameter.
"""

from __future__ import annotations

from tito_derender.parsers.tools.markup import WAIT, KeyValueArguments, MarkupToolParser, immediate

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
#: Where a value ends: a closing marker followed (after whitespace) by one of its followers.
VALUE_ENDS = {PARAMETER_END: (PARAMETER, FUNCTION_END), FUNCTION_END: (END,)}


def strip_one_newline(value: str) -> str:
    """The value without the one newline the template puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(MarkupToolParser):
    #: A call opened inside the reasoning may end it (see ToolParser.call_markers).
    call_markers = (START, END)

    #: How a parameter missing from the schema is typed (see markup.typed_value).
    unknown_parameters = "string"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._key = ""
        self._properties: tuple[str, ...] = ()  # the argument names the called tool declares
        self._openers: tuple[str, ...] = ()  # where the open value ends for a model that dropped `</parameter>`

    def _content_state(self, text: str) -> str | None:
        # `<function=` alone opens a call too: the model dropped `<tool_call>` (vLLM reads it so)
        return self._open_first(text, {START: self._function, FUNCTION: self._function_name})

    def _function(self, text: str) -> str | None:
        return self._expect(text, {FUNCTION: self._function_name})

    def _function_name(self, text: str) -> str | None:
        split = self._header(text, ">")
        if not split:
            return WAIT if split is None else self._give_up(text)
        name, _, after = split
        name = name.strip()
        if not name or not self.accept_name(name):
            return self._give_up(text)
        text = self._consume(text, len(text) - len(after))
        self._call = KeyValueArguments(self, name, self.unknown_parameters)
        self._properties = self.property_names(name)
        self._state = self._body
        return text

    def _body(self, text: str) -> str | None:
        return self._expect(text, {PARAMETER: self._parameter_key, FUNCTION_END: self._function_end})

    def _parameter_key(self, text: str) -> str | None:
        split = self._header(text, ">")
        if not split:
            return WAIT if split is None else self._give_up(text)
        key, _, after = split
        self._begin_value(key)
        return self._consume(text, len(text) - len(after))

    def _begin_value(self, key: str) -> None:
        """The value of `key` begins. It ends early at a `<parameter=NAME>` naming an argument of
        the tool that is not given yet (the model dropped `</parameter>`); any other
        `<parameter=` text stays in the value (code or markup the tool writes)."""
        self._key, self._state = key, self._parameter_value
        given = self._call.keys | {key.strip()}
        self._openers = tuple(f"{PARAMETER}{name}>" for name in self._properties if name not in given)
        self._call.begin_value(key, trim_newline=True, stop_at=PARAMETER)

    def _parameter_value(self, text: str) -> str | None:
        found = self._scan_value(text, VALUE_ENDS, self._openers)
        if found is None:
            return ""
        value, marker, rest = found
        if not self._add_values(value, dropped_closes=marker == FUNCTION_END):
            return self._give_up(rest)
        if marker == FUNCTION_END:  # `</function>` right after the value (its `</parameter>` dropped)
            return self._function_end(rest)
        if marker in self._openers:  # the next parameter, its `</parameter>` dropped
            self._begin_value(marker[len(PARAMETER):-1])
            return rest
        self._state = self._body
        return rest

    def _add_values(self, value: str, dropped_closes: bool) -> bool:
        """Add the value of the current key; False when the call is malformed. A value that ended
        at `</function>` with no `</parameter>` anywhere in it comes from a model that drops its
        closing markers: a `<parameter=` in it starts the next parameter."""
        pieces = [(self._key, value)]
        if dropped_closes and PARAMETER_END not in value and PARAMETER in value:
            first, *others = value.split(PARAMETER)
            pieces = [(self._key, first)]
            for other in others:
                key, separator, rest = other.partition(">")
                if not separator:
                    return False
                pieces.append((key, rest))
        return all(self._call.add(key.strip(), strip_one_newline(raw)) for key, raw in pieces)

    def finish(self):
        """At the end of the output, a `</function>` with nothing after it ends its value (the
        model dropped `</parameter>` and `</tool_call>`, or a stop token ended the output)."""
        if self._state == self._parameter_value and self._pending.startswith(FUNCTION_END) \
                and not self._pending[len(FUNCTION_END):].strip():
            value = "".join(self._parts)
            self._parts, self._pending = [], ""
            if self._add_values(value, dropped_closes=True):
                self._function_end("")
        return super().finish()

    @immediate
    def _function_end(self, text: str) -> str | None:
        self._call.close()
        self._done()
        self._state = self._after_function
        return text

    def _after_function(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            return WAIT
        if stripped.startswith(END):
            self._state = self._content_state
            return stripped[len(END):]
        if END.startswith(stripped):
            return WAIT
        self._state = self._content_state  # a forgotten </tool_call>: the rest is content
        self._closing = False
        return text


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = Qwen3CoderToolParser
