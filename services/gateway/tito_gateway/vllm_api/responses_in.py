"""OpenAI's Responses body (`/v1/responses/render`) -> an OpenAI chat body, as vLLM 0.32 builds
the chat it renders for a model without Harmony (construct_input_messages): `instructions` as a
leading system message, then `input` (a string: one user message; or message items, each a role
and a string or `input_text` / `output_text` parts), with `max_output_tokens`, `temperature`,
`top_p`, `top_k`, `stream`, `cache_salt`, `chat_template_kwargs`, and OpenAI's account fields
(`user`, `metadata`, `store`, `service_tier`) type-checked and not used. Tools, earlier responses
(`previous_response_id`, which vLLM's stateless render refuses too), reasoning and text formats
are refused with a 400 naming them, never dropped.

Domain code: no HTTP here."""

from __future__ import annotations

from typing import Any

from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported

MAPPED = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "stream": "stream", "cache_salt": "cache_salt", "chat_template_kwargs": "chat_template_kwargs",
          "user": "user", "metadata": "metadata", "store": "store", "service_tier": "service_tier"}
#: Fields refused unless they hold the value that asks for nothing.
NOT_MAPPED = {"tools": [], "tool_choice": "auto", "previous_response_id": None, "reasoning": None, "text": None,
              "include": None, "background": False, "max_tool_calls": None, "prompt": None, "top_logprobs": 0,
              "truncation": "disabled", "parallel_tool_calls": True}
FIELDS = frozenset(("model", "input", "instructions", *MAPPED, *NOT_MAPPED))
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat(values: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat body vLLM renders for this Responses body."""
    for name, value in values.items():
        if name not in FIELDS:
            raise unsupported(name, "unknown field of OpenAI's Responses request")
        if name in NOT_MAPPED and value is not None and value != NOT_MAPPED[name]:
            raise unsupported(name, "not mapped on this endpoint yet; render the chat at /v1/chat/completions/render")
    messages: list[dict] = []
    instructions = openai_in._string(values.get("instructions"), "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = values.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages.extend(_item(item, f"input[{index}]") for index, item in enumerate(given))
    else:
        raise invalid("input", "is required: a string or an array of message items")
    chat: dict[str, Any] = {"model": values.get("model"), "messages": messages}
    for source, target in MAPPED.items():
        if values.get(source) is not None:
            chat[target] = values[source]
    return chat


def _item(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(where, "must be a message item")
    for key in value:
        if key not in ("type", "role", "content"):
            raise unsupported(f"{where}.{key[:64]}", "only message items (role and content) are mapped")
    if value.get("type", "message") != "message":
        raise unsupported(f"{where}.type", "only message items are mapped (no function calls or reasoning yet)")
    role = openai_in._string(value.get("role"), f"{where}.role", True)
    if role not in ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    content = value.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise invalid(f"{where}.content", "must be a string or an array of text parts")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise unsupported(f"{at}.type", "only input_text and output_text parts are mapped")
        texts.append(openai_in._string(part.get("text"), f"{at}.text", True))
    if role == "assistant":  # vLLM keeps an assistant item's first text
        return {"role": role, "content": texts[0]}
    return {"role": role, "content": [{"type": "text", "text": text} for text in texts]}
