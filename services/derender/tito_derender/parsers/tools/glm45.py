"""GLM-4.5 tool calls:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

Values are typed by the tool's JSON schema (see markup.typed_value); a key the schema does not
know is parsed as JSON when it is JSON (the template writes non-string values with tojson), else
kept as a string, as in vLLM. The markers are special tokens of GLM's tokenizer: render keeps
special tokens in the text for this parser (skip_special_tokens defaults to false).
"""

from __future__ import annotations

from tito_derender.parsers.tools.markup import WAIT, KeyValueArguments, MarkupToolParser, immediate

START = "<tool_call>"
END = "</tool_call>"
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
#: Where a value ends: `</arg_value>` followed (after whitespace) by the next key or the call's end;
#: a value may hold markup itself, `</arg_value>` text included.
VALUE_ENDS = {VALUE_END: (KEY, END)}


class Glm45ToolParser(MarkupToolParser):
    #: A call opened inside the reasoning may end it (see ToolParser.call_markers).
    call_markers = (START, END)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._key = ""

    def _content_state(self, text: str) -> str | None:
        return self._open(text, START, self._name)

    def _name(self, text: str) -> str | None:
        split = self._header(text, "\n", KEY, END)
        if not split:
            return WAIT if split is None else self._give_up(text)
        name, marker, _ = split
        name = name.strip()
        if not name or not self.accept_name(name):
            return self._give_up(text)
        text = self._consume(text, len(text) - len(marker) - len(split[2]))  # up to the marker
        self._call = KeyValueArguments(self, name, "json")
        self._state = self._body
        return text

    def _body(self, text: str) -> str | None:
        return self._expect(text, {KEY: self._key_text, END: self._call_end})

    def _key_text(self, text: str) -> str | None:
        split = self._header(text, KEY_END)
        if not split:
            return WAIT if split is None else self._give_up(text)
        self._key, _, after = split
        self._state = self._value_open
        return self._consume(text, len(text) - len(after))

    def _value_open(self, text: str) -> str | None:
        return self._expect(text, {VALUE: self._value})

    def _value(self, text: str) -> str | None:
        found = self._scan_value(text, VALUE_ENDS)
        if found is None:
            return ""
        value, _, rest = found
        if not self._call.add(self._key.strip(), value):
            return self._give_up(rest)
        self._state = self._body
        return rest

    @immediate
    def _call_end(self, text: str) -> str | None:
        self._call.close()
        self._done()
        self._state = self._content_state
        return text


#: The parser of this format (tito.parsers finds it here by the format name).
PARSER = Glm45ToolParser
