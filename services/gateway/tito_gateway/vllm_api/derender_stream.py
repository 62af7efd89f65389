"""vLLM's streamed derender bodies (`stream: true`: one `generate_chunk` per call plus the
`stream_state` the previous call returned) -> derender's resumable stream, and its chunks ->
vLLM's `{"chunk": ..., "stream_state": ...}` answer.

Domain code: no HTTP here. vLLM's `stream_state` is an object holding every output token so
far, which its derender replays through a fresh parser on every call (O(n) per chunk). tito's is
derender's own state, sealed by derender (tito_derender.resume: an HMAC-SHA256 tag under a key
only derender holds, capped at 64 KiB), carried as one base64url string: its size depends on
what derender still holds back, not on how long the output is, and a call costs its own tokens.
The caller treats it as opaque and sends back what it got, as with vLLM's."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tito.errors import InvalidArgument
from tito.v1 import derender_pb2, engine_pb2
from tito_gateway import openai_in, openai_out
from tito_gateway.openai_in import invalid
from tito_gateway.vllm_api import derender_in

FIELD = "stream_state"
#: derender's cap on a sealed state (tito_derender.resume.MAX_STATE_BYTES), as base64 characters:
#: a longer string is refused before it is decoded or sent on.
MAX_STATE_CHARS = (64 * 1024 + 2) // 3 * 4
CHAT_FIELDS = frozenset(("stream", "model", "generate_chunk", "stream_state", "prompt_tokens",
                         "prompt_token_ids", "chat_request"))
COMPLETION_FIELDS = frozenset(("stream", "model", "generate_chunk", "stream_state", "prompt_tokens",
                               "prompt_token_ids", "completion_request"))
CHUNK_FIELDS = frozenset(("request_id", "choices", "usage", "prompt_token_ids", "mm_placeholders", "metrics",
                          "output_mode", "kv_transfer_params", "ec_transfer_params", "prompt_logprobs",
                          "prompt_token_id_logprobs", "model", "created"))


def is_streamed(values: dict[str, Any]) -> bool:
    return values.get("stream") is True


def state_bytes(value: Any) -> bytes:
    """The caller's `stream_state` as derender's sealed bytes (empty on the first call)."""
    if value is None:
        return b""
    if not isinstance(value, str):
        raise invalid(FIELD, "must be the string the previous derender call returned (tito's stream state is "
                             "opaque, not vLLM's object), or null on the first chunk")
    if len(value) > MAX_STATE_CHARS:
        raise InvalidArgument(f"stream_state is {len(value)} characters, more than derender ever returns "
                              f"({MAX_STATE_CHARS})", reason="STREAM_STATE_TOO_LARGE", field=FIELD)
    try:
        return base64.urlsafe_b64decode(value.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise invalid(FIELD, "is not base64url: send back the state of the previous call unchanged") from None


def state_text(state: bytes) -> str:
    return base64.urlsafe_b64encode(state).decode("ascii")


def chunk_responses(value: Any) -> tuple[str, list[engine_pb2.GenerateResponse], dict | None]:
    """One `generate_chunk` -> its request id, one engine response per choice (no usage: derender
    counts the tokens it was sent across calls) and the chunk's usage."""
    where = "generate_chunk"
    if not isinstance(value, dict):
        raise invalid(where, "is required: one chunk of /inference/v1/generate's stream")
    for key in value:
        if key not in CHUNK_FIELDS:
            raise openai_in.unsupported(f"{where}.{key[:64]}", "unknown field of vLLM's GenerateTokensStreamResponse")
    if value.get("output_mode", "tokens") != "tokens":
        raise openai_in.unsupported(f"{where}.output_mode", "only \"tokens\" chunks are derendered")
    choices = value.get("choices")
    if not isinstance(choices, list):
        raise invalid(f"{where}.choices", "must be an array of choices")
    if len(choices) > 1:  # vLLM's check: one state threads one choice
        raise invalid(f"{where}.choices", f"holds {len(choices)} choices: a streamed chunk carries at most one")
    responses = [derender_in.choice_response(choice, f"{where}.choices[{i}]", streamed=True)
                 for i, choice in enumerate(choices)]
    usage = value.get("usage")
    request_id = openai_in._string(value.get("request_id"), f"{where}.request_id") or ""
    return request_id, responses, usage if isinstance(usage, dict) else None


def usage_json(usage: dict | None, prompt_tokens: int | None) -> dict | None:
    """vLLM's: the chunk's usage, the prompt count the caller gave winning."""
    if usage is None:
        return None
    prompt = prompt_tokens if prompt_tokens is not None else _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None}


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def chat_choice(index: int, chunk: derender_pb2.ChatChunk | None, logprobs: bool) -> dict:
    """The stream choice for one generate choice: derender's chunk, or an empty delta while
    derender holds the text back (vLLM answers each call with a chunk too)."""
    delta: dict = {}
    if chunk is None:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    if chunk.role:
        delta["role"] = chunk.role
    if chunk.content:
        delta["content"] = chunk.content
    if chunk.reasoning_content:
        delta["reasoning"] = chunk.reasoning_content
    if chunk.tool_calls:
        delta["tool_calls"] = [openai_out.tool_call_delta(call) for call in chunk.tool_calls]
    return {"index": index, "delta": delta,
            "logprobs": {"content": openai_out.chat_logprobs(chunk.logprobs)} if logprobs and chunk.logprobs else None,
            "finish_reason": openai_out.finish_reason(chunk)}


def completion_choice(index: int, chunk: derender_pb2.ChatChunk | None, logprobs: bool) -> dict:
    """The stream choice of a completion; logprobs' `text_offset` counts from this chunk's text
    (the state does not carry the text length sent before)."""
    if chunk is None:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None}
    return {"index": index, "text": chunk.content,
            "logprobs": openai_out.completion_logprobs(chunk.logprobs, 0) if logprobs and chunk.logprobs else None,
            "finish_reason": openai_out.finish_reason(chunk)}
