"""Qwen3-Coder tool calls (XML):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Values are text, typed by the tool's JSON schema (see markup.typed_value: strings stay raw,
numbers / booleans / objects are parsed; a key the schema does not know stays a string, as in
vLLM). The newline the template writes on each side of a value is not part of it. A value may
also end at the next `<parameter=` or at `</function>` (models sometimes drop `</parameter>`).
Arguments stream one member per completed parameter.
"""

from __future__ import annotations

from tito_derender.parsers.tools.markup import WAIT, KeyValueArguments, MarkupToolParser, immediate

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


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

    def _content_state(self, text: str) -> str | None:
        return self._open(text, START, self._function)

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
        self._state = self._body
        return text

    def _body(self, text: str) -> str | None:
        return self._expect(text, {PARAMETER: self._parameter_key, FUNCTION_END: self._function_end})

    def _parameter_key(self, text: str) -> str | None:
        split = self._header(text, ">")
        if not split:
            return WAIT if split is None else self._give_up(text)
        self._key, _, after = split
        self._state = self._parameter_value
        return self._consume(text, len(text) - len(after))

    def _parameter_value(self, text: str) -> str | None:
        found = self._collect(text, PARAMETER_END, PARAMETER, FUNCTION_END)
        if found is None:
            return ""
        value, marker, before = found
        if not self._call.add(self._key.strip(), strip_one_newline(value)):
            return self._give_up(text)
        self._state = self._body
        # A missing </parameter>: the next parameter or the function end is read as such.
        return self._consume(text, before + (len(marker) if marker == PARAMETER_END else 0))

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
        return stripped
