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
        self._properties: tuple[str, ...] = ()  # the argument names the called tool declares
        self._openers: tuple[str, ...] = ()  # where the open value ends for a model that dropped `</arg_value>`

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
        self._properties = self.property_names(name)
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
        return self._expect(text, {VALUE: self._value_start})

    @immediate
    def _value_start(self, text: str) -> str | None:
        """The value of the current key begins. It ends early at an `<arg_key>NAME</arg_key>`
        naming an argument of the tool that is not given yet (the model dropped `</arg_value>`);
        other `<arg_key>` text stays in the value."""
        given = self._call.keys | {self._key.strip()}
        self._openers = tuple(f"{KEY}{name}{KEY_END}" for name in self._properties if name not in given)
        self._call.begin_value(self._key)
        self._state = self._value
        return text

    def _value(self, text: str) -> str | None:
        found = self._scan_value(text, VALUE_ENDS, self._openers)
        if found is None:
            return ""
        value, marker, rest = found
        if not self._call.add(self._key.strip(), value):
            return self._give_up(rest)
        if marker in self._openers:  # the next key, its value's `</arg_value>` dropped
            self._key, self._state = marker[len(KEY):-len(KEY_END)], self._value_open
            return rest
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
