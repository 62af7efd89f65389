"""vLLM's own parameters of `/v1/chat/completions` beyond OpenAI's: `kv_transfer_params` (the
reuse path's forwarded ids, reuse.py, and prefill/decode's handoff, tito.kv_params) and `echo`;
and prefill/decode's `kv_transfer_params` on `/v1/completions` (one prompt per call).

Domain code: no HTTP here. A chat that carries any of them is a `VllmChatCall`: the gateway runs
it on a render answer it holds (kept, or rendered now) so it can set the engine's part in a
prefill/decode split and read the prefill's answer (`Handoff`) from the engine's last response.

`echo`, as vLLM's serving_chat: when true and the conversation's last message has the answer's
role (openai_in.answer_role: `assistant`, or the last message's own with `add_generation_prompt`
false), the answer's content starts with that message's content (text parts joined by newlines,
as vLLM's whole answer joins them); streamed, it is one chunk per choice right after the role
chunks. With echo on, the whole answer's content is a string even when there is nothing to echo
(vLLM prepends "" to it, so beside tool calls it is "" where it would be null).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tito.v1 import engine_pb2, multimodal_pb2
from tito import kv_params
from tito_gateway.openai_in import ChatCall, CompletionCall, invalid


@dataclass
class Handoff:
    """A prefill's answer for the decode call (vLLM's `kv_transfer_params`), once the engine gave it."""

    params: dict | None = None


@dataclass(frozen=True)
class VllmChatCall(ChatCall):
    """A chat with vLLM's extras: forwarded prompt ids (`key` finds their render answer in
    reuse.RenderedChats; empty: render the chat), a part in a prefill/decode split, `echo`."""

    prompt_ids: tuple[int, ...] = ()
    key: str = ""
    #: the forwarded media features (None: a text chat)
    features: multimodal_pb2.MultiModalFeatures | None = None
    #: the engine's part in a prefill/decode split (None: no kv_transfer_params beyond the reuse keys)
    kv_transfer: engine_pb2.KvTransfer | None = None
    #: where the engine's prefill answer lands (set when kv_transfer is)
    handoff: Handoff | None = field(default=None, compare=False)
    #: the text echoed before each choice's content (None: echo off; "": on, nothing to echo)
    echo: str | None = None

    @property
    def reused(self) -> bool:
        return bool(self.prompt_ids)


@dataclass(frozen=True)
class VllmCompletionCall(CompletionCall):
    """A one-prompt completion that is a part in a prefill/decode split."""

    kv_transfer: engine_pb2.KvTransfer | None = None
    handoff: Handoff = field(default_factory=Handoff, compare=False)


def split_transfer(values: dict[str, Any]) -> tuple[dict[str, Any], engine_pb2.KvTransfer | None]:
    """A completion body without `kv_transfer_params`, and the engine's part they give (None: none)."""
    rest = {key: value for key, value in values.items() if key != kv_params.FIELD}
    params = values.get(kv_params.FIELD)
    return rest, (kv_params.kv_transfer_from_params(params) if params is not None else None)


def echo_flag(values: dict[str, Any]) -> bool:
    """A chat body's `echo` (absent or null: false)."""
    echo = values.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", "must be a boolean")
    return bool(echo)


def echo_text(messages: list, role: str) -> str:
    """The text `echo` puts before each answer: the last message's, when it has the answer's
    `role` (parse_chat has checked the messages)."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != role:
        return ""
    return _text(last.get("content"))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # vLLM joins the text parts with newlines
        return "\n".join(part.get("text", "") for part in content
                         if isinstance(part, dict) and part.get("type", "text") == "text")
    return ""
