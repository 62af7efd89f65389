"""Anthropic's Messages body (`/v1/messages/render`) -> an OpenAI chat body, as vLLM 0.32 converts
it (AnthropicServingMessages.to_chat_completion_request), for the part tito maps: the top-level
`system` (a string or text blocks, joined), messages whose content is a string or blocks of
`text`, `image` (a base64 or URL source) and `thinking` (earlier reasoning), `max_tokens`,
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata`, `cache_salt`,
`chat_template_kwargs`. Tools, tool blocks, `thinking` and `output_config` are refused with a 400
naming them (not mapped yet), never dropped.

Domain code: no HTTP here."""

from __future__ import annotations

from typing import Any

from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported

FIELDS = frozenset(("model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system",
                    "temperature", "top_k", "top_p", "cache_salt", "chat_template_kwargs", "tools", "tool_choice",
                    "thinking", "output_config"))
NOT_MAPPED = {"tools": "tools are not mapped on this endpoint yet; render the chat at /v1/chat/completions/render",
              "tool_choice": "tools are not mapped on this endpoint yet",
              "thinking": "use chat_template_kwargs (e.g. {\"enable_thinking\": false})",
              "output_config": "use /v1/chat/completions/render with response_format"}
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
        converted = _message(message, f"messages[{index}]")
        if converted is not None:
            messages.append(converted)
    chat: dict[str, Any] = {"model": values.get("model"), "messages": messages, "max_tokens": max_tokens}
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


def _message(value: Any, where: str) -> dict | None:
    if not isinstance(value, dict):
        raise invalid(where, "must be a message object")
    role = openai_in._string(value.get("role"), f"{where}.role", True)
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", "must be user or assistant (the system prompt is the top-level system)")
    content = value.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "must be a string or an array of content blocks")
    parts, reasoning = [], []
    for index, block in enumerate(content):
        _block(block, f"{where}.content[{index}]", parts, reasoning)
    out: dict[str, Any] = {"role": role}
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    elif not reasoning:
        return None  # vLLM leaves out a message with nothing in it
    return out


def _block(block: Any, where: str, parts: list, reasoning: list) -> None:
    if not isinstance(block, dict):
        raise invalid(where, "must be a content block object")
    kind = openai_in._string(block.get("type"), f"{where}.type", True)
    if kind == "text":
        text = openai_in._string(block.get("text"), f"{where}.text")
        if text:
            parts.append({"type": "text", "text": text})
    elif kind == "image":
        parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{where}.source")}})
    elif kind == "thinking":
        thought = openai_in._string(block.get("thinking"), f"{where}.thinking")
        if thought is not None:
            reasoning.append(thought)
    elif kind != "redacted_thinking":  # opaque: accepted and skipped, as vLLM does
        raise unsupported(f"{where}.type", f"content block {kind[:32]!r} is not mapped (text, image, thinking)")


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
