"""vLLM's own parameters of `/v1/chat/completions` beyond OpenAI's: `kv_transfer_params` (the
reuse path's forwarded ids, reuse.py, and prefill/decode's handoff, tito.kv_params) and `echo`;
and prefill/decode's `kv_transfer_params` on `/v1/completions` (one prompt per call).

Domain code: no HTTP here. A chat that carries any of them is a `VllmChatCall`: the gateway runs
it on a render answer it holds (kept, or rendered now) so it can set the engine's part in a
prefill/decode split and read the prefill's answer (`Handoff`) from the engine's last response.

`echo`, as vLLM's serving_chat: when true and the conversation's last message has the role the
answer has (`assistant`, or the last message's own role with `add_generation_prompt` false), the
answer's content starts with that message's content (text parts joined by newlines); streamed,
it is one chunk per choice right after the role chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tito.v1 import engine_pb2, multimodal_pb2
from tito import kv_params
from tito_gateway.openai_in import ChatCall, CompletionCall, invalid

#: The role vLLM's chat answers with (its --response-role default).
RESPONSE_ROLE = "assistant"


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
    #: the text echoed before each choice's content (None: no echo)
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


def echo_text(values: dict[str, Any]) -> str | None:
    """The text a chat body's `echo` puts before each answer (None: echo off or nothing to echo)."""
    echo = values.get("echo")
    if echo is None or echo is False:
        return None
    if echo is not True:
        raise invalid("echo", "must be a boolean")
    messages = values.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None  # parse_chat names what is wrong with the messages
    last = messages[-1]
    role = RESPONSE_ROLE if values.get("add_generation_prompt", True) is not False else last.get("role")
    if last.get("role") != role:
        return None
    return _text(last.get("content")) or None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # vLLM joins the text parts with newlines
        return "\n".join(part.get("text", "") for part in content
                         if isinstance(part, dict) and part.get("type", "text") == "text")
    return ""
