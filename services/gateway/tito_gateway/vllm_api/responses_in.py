"""OpenAI's Responses body (`/v1/responses/render`) -> an OpenAI chat body, as vLLM 0.32 builds
the chat it renders for a model without Harmony (construct_input_messages): `instructions` as a
leading system message, then `input` (a string: one user message; or items: messages, each a
role and a string or `input_text` / `output_text` parts; `function_call` items, an assistant's
tool calls, merged into the assistant message before them as vLLM merges them; and
`function_call_output` items, `tool` messages), with `tools` (function tools, flat as the
Responses API writes them, nested as a chat's), `tool_choice` (`auto`, `none`, `required` or
`{"type": "function", "name": ...}`), `parallel_tool_calls`, `max_output_tokens`, `temperature`,
`top_p`, `top_k`, `stream`, `cache_salt`, `chat_template_kwargs`, and OpenAI's account fields
(`user`, `metadata`, `store`, `service_tier`) type-checked and not used. Built-in tools, earlier
responses (`previous_response_id`, which vLLM's stateless render refuses too), reasoning and
text formats are refused with a 400 naming them, never dropped.

Domain code: no HTTP here."""

from __future__ import annotations

from typing import Any

from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported

MAPPED = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "stream": "stream", "cache_salt": "cache_salt", "chat_template_kwargs": "chat_template_kwargs",
          "user": "user", "metadata": "metadata", "store": "store", "service_tier": "service_tier",
          "parallel_tool_calls": "parallel_tool_calls"}
#: Fields refused unless they hold the value that asks for nothing.
NOT_MAPPED = {"previous_response_id": None, "reasoning": None, "text": None,
              "include": None, "background": False, "max_tool_calls": None, "prompt": None, "top_logprobs": 0,
              "truncation": "disabled"}
FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice", *MAPPED, *NOT_MAPPED))
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
TOOL_CHOICES = ("auto", "none", "required")
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
        for index, item in enumerate(given):
            _add(messages, _item(item, f"input[{index}]"))
    else:
        raise invalid("input", "is required: a string or an array of message items")
    chat: dict[str, Any] = {"model": values.get("model"), "messages": messages}
    for source, target in MAPPED.items():
        if values.get(source) is not None:
            chat[target] = values[source]
    if values.get("tools"):
        chat["tools"] = _tools(values["tools"])
    if values.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(values["tool_choice"])
    return chat


def _add(messages: list[dict], message: dict) -> None:
    """Append `message`, or merge it into the assistant message before it as vLLM does: tool
    calls join its calls, a text its missing content."""
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if last is not None and message["role"] == "assistant":
        if "tool_calls" in message and "content" not in message:
            last.setdefault("tool_calls", []).extend(message["tool_calls"])
            return
        if "content" in message and last.get("content") is None:
            last["content"] = message["content"]
            return
    messages.append(message)


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid("tools", "must be an array of tools")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise unsupported(f"{where}.type", "only function tools are mapped (no built-in tools)")
        for key in tool:
            if key not in TOOL_FIELDS:
                raise unsupported(f"{where}.{key[:64]}", "unknown field of a function tool")
        out.append({"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise invalid("tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or a function")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise unsupported("tool_choice", "only auto, none, required or {\"type\": \"function\", \"name\": ...}")
    for key in choice:
        if key not in ("type", "name"):
            raise unsupported(f"tool_choice.{key[:64]}", "unknown field of a function tool choice")
    return {"type": "function", "function": {"name": openai_in._string(choice.get("name"), "tool_choice.name", True)}}


def _item(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(where, "must be a message item")
    kind = value.get("type", "message")
    if kind in ("function_call", "function_call_output"):
        return _call_item(value, where, kind)
    if kind != "message":
        raise unsupported(f"{where}.type", "message, function_call and function_call_output items are mapped (no "
                                           "reasoning items yet)")
    for key in value:
        if key not in ("type", "role", "content"):
            raise unsupported(f"{where}.{key[:64]}", "unknown field of a message item")
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


def _call_item(value: dict, where: str, kind: str) -> dict:
    """A function_call item (the assistant's call) or its function_call_output (a tool message)."""
    fields = ("type", "call_id", "name", "arguments", "id", "status") if kind == "function_call" else \
        ("type", "call_id", "output", "id", "status")
    for key in value:
        if key not in fields:
            raise unsupported(f"{where}.{key[:64]}", f"unknown field of a {kind} item")
    call_id = openai_in._string(value.get("call_id"), f"{where}.call_id", True)
    if kind == "function_call_output":
        output = value.get("output")
        if not isinstance(output, str):
            raise unsupported(f"{where}.output", "only a string output is mapped")
        return {"role": "tool", "content": output, "tool_call_id": call_id}
    return {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": openai_in._string(value.get("name"), f"{where}.name", True),
        "arguments": openai_in._string(value.get("arguments"), f"{where}.arguments", True)}}]}
