"""What some real chat templates need from the message dicts beyond the OpenAI shape.

- Tool-call arguments: render passes them as the JSON string the caller sent (so that a template
  that tests `arguments is string` prints exactly that text, as HF would). Other templates read
  them as a mapping (Qwen3-Coder `|items`, GLM-4.5 `.items()`, gpt-oss `|tojson`) or concatenate
  them as text (DeepSeek-V3.1 `'...' + arguments`). For those, `JsonArguments` is both: a dict of
  the parsed object that prints, and concatenates, as the original text.
- Reasoning history: a template that reads an assistant turn's reasoning from `thinking` (gpt-oss)
  and not from `reasoning_content` gets `thinking` set from `reasoning_content`.
- A tool-call turn without content: OpenAI clients send `content: null`, which the wire cannot
  carry (the field is just absent). A template that tests `content is none` (DeepSeek-R1, V3.1)
  gets the None it would get from such a client; others keep the key absent.

Messages that need no change are passed on as they are; changed ones are copies.
"""

from __future__ import annotations

import json
import re
from typing import Any

_TESTS_ARGUMENTS_IS_STRING = re.compile(r"arguments(?:'\]|\"\])?\s+is\s+string")
_TESTS_CONTENT_IS_NONE = re.compile(r"(?:\['content'\]|\[\"content\"\]|\.content)\s+is\s+(?:not\s+)?none")


class JsonArguments(dict):
    """A tool call's arguments: the parsed JSON object, printing as the JSON text it came from."""

    def __init__(self, text: str) -> None:
        super().__init__(json.loads(text))
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: Any) -> Any:
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self.text if isinstance(other, str) else NotImplemented


def template_source(tokenizer: Any, override: str | None) -> str:
    """The text of the template that will run (a dict of named templates: all of them)."""
    template = override if override is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(value) for value in template.values())
    return template or ""


def adapt_messages(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """The messages as `template` needs them (see the module docstring)."""
    wrap_arguments = "arguments" in template and not _TESTS_ARGUMENTS_IS_STRING.search(template)
    alias_thinking = "thinking" in template and "reasoning_content" not in template
    none_content = bool(_TESTS_CONTENT_IS_NONE.search(template))
    if not (wrap_arguments or alias_thinking or none_content):
        return messages
    return [_adapt(message, wrap_arguments, alias_thinking, none_content) for message in messages]


def _adapt(message: dict[str, Any], wrap_arguments: bool, alias_thinking: bool,
           none_content: bool) -> dict[str, Any]:
    if message.get("role") != "assistant":
        return message
    adapted = message
    if none_content and "content" not in message and message.get("tool_calls"):
        adapted = dict(message, content=None)
    if alias_thinking and "reasoning_content" in message and "thinking" not in message:
        adapted = dict(adapted, thinking=message["reasoning_content"])
    if wrap_arguments and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                call = dict(call, function=dict(call["function"], arguments=JsonArguments(arguments)))
            calls.append(call)
        adapted = dict(adapted, tool_calls=calls)
    return adapted
