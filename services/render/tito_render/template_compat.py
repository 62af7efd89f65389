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
- The `developer` role (OpenAI's newer name for the system prompt, which SDKs send): a template
  that never names it gets it as `system`, as vLLM gives it (`developer_as_system`).

Messages that need no change are passed on as they are; changed ones are copies.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tito.errors import InvalidArgument

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
    messages = developer_as_system(messages, template)
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


def knows_developer_role(template: str) -> bool:
    """Whether the template names the `developer` role (vLLM's test: the quoted name in its text)."""
    return '"developer"' in template or "'developer'" in template


def developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """vLLM's rule (renderers/hf.py, `safe_apply_chat_template`): on a template that does not name
    `developer`, developer messages become system messages, and when that leaves a system message
    anywhere but first, or several, they are merged into one system message first (their texts
    joined by a blank line), since templates such as Qwen's only read a leading system message.
    A template that knows the role gets the messages unchanged."""
    if knows_developer_role(template) or not any(message.get("role") == "developer" for message in messages):
        return messages
    converted = [dict(message, role="system") if message.get("role") == "developer" else message
                 for message in messages]
    return _merge_system_messages(converted)


def _merge_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(messages):
        if message.get("role") != "system":
            others.append(message)
            continue
        merge = merge or index > 0 or bool(texts)
        text = _system_text(message.get("content"), index)
        if text:
            texts.append(text)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


def _system_text(content: Any, index: int) -> str:
    """A system message's text, its text parts joined by newlines (as vLLM joins them). vLLM drops
    any other part there; here an image would lose its place in the prompt while its pixels still
    go to the model, so it is refused instead, naming the part."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for position, part in enumerate(content):
        if part.get("type") != "text":
            raise InvalidArgument(
                f"this model's chat template has no developer role: developer messages become system messages, "
                f"merged into one text: send the {part.get('type')} in a user message",
                reason="CHAT_TEMPLATE_ERROR", field=f"messages[{index}].content_parts[{position}]")
        texts.append(part["text"])
    return "\n".join(texts)
