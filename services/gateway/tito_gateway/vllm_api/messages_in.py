"""Anthropic's Messages body (`/v1/messages/render`) -> an OpenAI chat body, as vLLM 0.32 converts
it (AnthropicServingMessages.to_chat_completion_request), for the part tito maps: the top-level
`system` (a string or text blocks, joined), messages whose content is a string or blocks of
`text`, `image` (a base64 or URL source), `thinking` (earlier reasoning), `tool_use` (the
assistant's call: an OpenAI tool call whose arguments are `json.dumps(input)`, as vLLM writes
them) and `tool_result` (a user's block: a `tool` message before the user's own, its images in
a user message after it; an assistant's: a `Tool result: ...` text part), `tools` (OpenAI
function tools, `input_schema` as `parameters`), `tool_choice` (`auto`, `any` -> `required`,
`none`, `tool` -> the named function; `disable_parallel_tool_use` -> `parallel_tool_calls`),
`max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata`,
`cache_salt`, `chat_template_kwargs`. `thinking`, `output_config`, server tools and the tool
blocks vLLM resolves into its tool list (`tool_reference`, `tool_addition`, ...) are refused with
a 400 naming them (not mapped yet), never dropped.

Domain code: no HTTP here."""

from __future__ import annotations

import json
from typing import Any

from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported

FIELDS = frozenset(("model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system",
                    "temperature", "top_k", "top_p", "cache_salt", "chat_template_kwargs", "tools", "tool_choice",
                    "thinking", "output_config"))
NOT_MAPPED = {"thinking": "use chat_template_kwargs (e.g. {\"enable_thinking\": false})",
              "output_config": "use /v1/chat/completions/render with response_format"}
TOOL_FIELDS = ("type", "name", "description", "input_schema", "strict", "defer_loading", "cache_control")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
#: vLLM drops a system text block that starts so: its per-request hash defeats prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"


def to_chat(values: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body vLLM renders for this Messages body."""
    for name, value in values.items():
        if name not in FIELDS:
            raise unsupported(name, "unknown field of Anthropic's Messages request")
        if name in NOT_MAPPED and value is not None:
            raise unsupported(name, NOT_MAPPED[name])
    body = openai_in.Body(values, FIELDS)
    max_tokens = body.integer("max_tokens", 1, openai_in.UINT32_MAX)
    if max_tokens is None:
        raise invalid("max_tokens", "is required")
    messages = _system(values.get("system"))
    given = values.get("messages")
    if not isinstance(given, list):
        raise invalid("messages", "is required: an array of messages")
    for index, message in enumerate(given):
        messages.extend(_message(message, f"messages[{index}]"))
    chat: dict[str, Any] = {"model": values.get("model"), "messages": messages, "max_tokens": max_tokens}
    chat.update(_tool_choice(values.get("tool_choice")))
    if values.get("tools") is not None:
        chat["tools"] = _tools(values["tools"])
        chat.setdefault("tool_choice", "auto")
    for source, target in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("top_k", "top_k"), ("stream", "stream"), ("cache_salt", "cache_salt"),
                           ("chat_template_kwargs", "chat_template_kwargs")):
        if values.get(source) is not None:
            chat[target] = values[source]
    body.obj("metadata")  # Anthropic's user_id and the like: type-checked, not used (nor by vLLM)
    return chat


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = [_text(block, f"system[{i}]") for i, block in enumerate(system)]
        texts = [text for text in texts if text and not text.startswith(BILLING_HEADER)]
    else:
        raise invalid("system", "must be a string or an array of text blocks")
    text = "".join(texts)
    return [{"role": "system", "content": text}] if text else []


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise unsupported(f"{where}.type", "only text blocks here")
    return openai_in._string(block.get("text"), f"{where}.text") or ""


def _message(value: Any, where: str) -> list[dict]:
    """One Anthropic message -> the chat messages vLLM makes of it (tool results first)."""
    if not isinstance(value, dict):
        raise invalid(where, "must be a message object")
    role = openai_in._string(value.get("role"), f"{where}.role", True)
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", "must be user or assistant (the system prompt is the top-level system)")
    content = value.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or an array of content blocks")
    converted = _Converted(role)
    for index, block in enumerate(content):
        _block(block, f"{where}.content[{index}]", converted)
    out: dict[str, Any] = {"role": role}
    if converted.reasoning:
        out["reasoning"] = "".join(converted.reasoning)
    if converted.tool_calls:
        out["tool_calls"] = converted.tool_calls
    parts = converted.parts
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    elif not converted.tool_calls and not converted.reasoning:
        return converted.before  # vLLM leaves out a message with nothing in it
    if role == "user" and "content" not in out:
        return converted.before
    return [*converted.before, out]


class _Converted:
    """What one message's blocks become: its parts, reasoning and tool calls, and the messages
    vLLM puts before it (a user's tool results)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.parts: list[dict] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict] = []
        self.before: list[dict] = []


def _block(block: Any, where: str, converted: _Converted) -> None:
    if not isinstance(block, dict):
        raise invalid(where, "must be a content block object")
    kind = openai_in._string(block.get("type"), f"{where}.type", True)
    if kind == "text":
        text = openai_in._string(block.get("text"), f"{where}.text")
        if text:
            converted.parts.append({"type": "text", "text": text})
    elif kind == "image":
        converted.parts.append({"type": "image_url",
                                "image_url": {"url": _image_url(block.get("source"), f"{where}.source")}})
    elif kind == "thinking":
        thought = openai_in._string(block.get("thinking"), f"{where}.thinking")
        if thought is not None:
            converted.reasoning.append(thought)
    elif kind == "tool_use":
        converted.tool_calls.append(_tool_use(block, where, len(converted.tool_calls)))
    elif kind == "tool_result":
        _tool_result(block, where, converted)
    elif kind != "redacted_thinking":  # opaque: accepted and skipped, as vLLM does
        raise unsupported(f"{where}.type", f"content block {kind[:32]!r} is not mapped (text, image, thinking, "
                                           f"tool_use, tool_result)")


def _tool_use(block: dict, where: str, index: int) -> dict:
    call_id = openai_in._string(block.get("id"), f"{where}.id") or f"call_{index}"
    name = openai_in._string(block.get("name"), f"{where}.name", True)
    arguments = block.get("input") or {}
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", "must be an object")
    # json.dumps with its default separators: the arguments text vLLM gives the template.
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool_result(block: dict, where: str, converted: _Converted) -> None:
    content = block.get("content")
    if converted.role != "user":  # vLLM keeps an assistant's as text
        if content is not None and not isinstance(content, str):
            raise unsupported(f"{where}.content", "an assistant's tool_result is mapped with string content only")
        converted.parts.append({"type": "text", "text": f"Tool result: {content or ''}"})
        return
    texts, images = [], []
    if isinstance(content, list):
        for index, item in enumerate(content):
            at = f"{where}.content[{index}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                texts.append(openai_in._string(item.get("text"), f"{at}.text") or "")
            elif kind == "image":
                images.append(_image_url(item.get("source"), f"{at}.source"))
            else:
                raise unsupported(f"{at}.type", "a tool result holds text and image blocks here")
        text = "\n".join(texts)
    elif content is None or isinstance(content, str):
        text = content or ""
    else:
        raise invalid(f"{where}.content", "must be a string or an array of blocks")
    call_id = openai_in._string(block.get("tool_use_id"), f"{where}.tool_use_id") or ""
    converted.before.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        converted.before.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}
                                                             for url in images]})


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid("tools", "must be an array of tools")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "must be a tool object")
        for key in tool:
            if key not in TOOL_FIELDS:
                raise unsupported(f"{where}.{key[:64]}", "unknown field of a tool (name, description, input_schema)")
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"{where}.type", "server tools are not mapped; declare a client tool")
        if tool.get("defer_loading"):
            raise unsupported(f"{where}.defer_loading", "deferred tools are not mapped")
        function = {"name": openai_in._string(tool.get("name"), f"{where}.name", True),
                    "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict:
    """The chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if choice is None:
        return {}
    if not isinstance(choice, dict):
        raise invalid("tool_choice", "must be an object")
    for key in choice:
        if key not in ("type", "name", "disable_parallel_tool_use"):
            raise unsupported(f"tool_choice.{key[:64]}", "unknown field of tool_choice")
    kind = openai_in._string(choice.get("type"), "tool_choice.type", True)
    disable = openai_in._boolean(choice.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use")
    chat: dict[str, Any] = {"parallel_tool_calls": not disable}
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {
            "name": openai_in._string(choice.get("name"), "tool_choice.name", True)}}
    elif kind in TOOL_CHOICES:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise invalid("tool_choice.type", "must be auto, any, none or tool")
    return chat


def _image_url(source: Any, where: str) -> str:
    if not isinstance(source, dict):
        raise invalid(where, "must be an image source object")
    if source.get("type") == "base64":
        media_type = openai_in._string(source.get("media_type"), f"{where}.media_type", True)
        data = openai_in._string(source.get("data"), f"{where}.data", True)
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url":
        return openai_in._string(source.get("url"), f"{where}.url", True)
    raise unsupported(f"{where}.type", "an image source is base64 or url")
