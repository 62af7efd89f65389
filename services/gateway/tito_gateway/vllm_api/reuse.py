"""The decode-side reuse path of `/v1/chat/completions` (vLLM's `kv_transfer_params.prompt_token_ids`):
a router that rendered the chat already forwards its token ids, and the chat runs on them.

Domain code: no HTTP here. The ids are checked as vLLM 0.32 checks them (a non-empty list of
JSON integers >= 0, exact types: `true` and `1.0` are refused; a 400 naming
`kv_transfer_params.prompt_token_ids`). A chat with media runs on them only with its features
forwarded too (`kv_transfer_params.prompt_features`, vLLM's MultiModalFeatures shape: hashes and
placeholders, with vLLM's serialized tensors where the vllm package is installed, or hashes only
for items the engine holds); without them it is rendered and the ids ignored, as vLLM 0.32 does.

The gateway has no tokenizer, template or parser of its own, so derender's context (parsers,
thinking switch, tools, stop strings) and the resolved sampling come from a render answer: the
one `/v1/chat/completions/render` made for the same chat body and the same ids, kept in a
bounded table (`RenderedChats`), so the router that rendered here never pays render twice. On
a miss (another gateway replica rendered it, or the entry was evicted) render runs on the chat
again for that context, and the engine still gets the forwarded ids, as vLLM runs them."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tito.v1 import multimodal_pb2, render_pb2
from tito_gateway.openai_in import invalid
from tito_gateway.vllm_api.derender_in import PROMPT_TAIL
from tito_gateway.vllm_api.generate_in import parse_features

FIELD = "kv_transfer_params.prompt_token_ids"
FEATURES_FIELD = "kv_transfer_params.prompt_features"
#: Body fields that change neither render's answer nor derender's context.
NOT_IN_KEY = frozenset(("kv_transfer_params", "stream", "stream_options", "request_id", "mm_payload", "priority",
                        "user", "metadata", "service_tier", "store"))
#: Render answers kept (a text chat's is a few KB: the ids and derender's context).
MAX_ENTRIES = 1024


@dataclass(frozen=True)
class Forwarded:
    """What `kv_transfer_params` forwards: the prompt's ids and, for media, its features."""

    ids: list[int]
    features: multimodal_pb2.MultiModalFeatures | None = None


#: The reuse path's keys of `kv_transfer_params`; the others are prefill/decode's (tito.kv_params).
REUSE_KEYS = ("prompt_token_ids", "prompt_features")


def split_forwarded(values: dict[str, Any]) -> tuple[dict[str, Any], Forwarded | None, dict[str, Any]]:
    """The body without `kv_transfer_params`, what to reuse (None: render the chat), and the
    prefill/decode keys of `kv_transfer_params` (empty: none), which travel to the engine."""
    params = values.get("kv_transfer_params")
    rest = {key: value for key, value in values.items() if key != "kv_transfer_params"}
    if params is None:
        return rest, None, {}
    if not isinstance(params, dict):
        raise invalid("kv_transfer_params", "must be an object")
    transfer = {key: value for key, value in params.items() if key not in REUSE_KEYS}
    ids, features = params.get("prompt_token_ids"), params.get("prompt_features")
    if ids is None:
        if features is not None:
            raise invalid(FEATURES_FIELD, "needs kv_transfer_params.prompt_token_ids, the ids its placeholders "
                                          "point into")
        return rest, None, transfer
    if values.get("echo") is True:
        # echo answers with the conversation's last message: rendered, the ids ignored unchecked (as vLLM)
        return rest, None, transfer
    if features is None and _has_media(values.get("messages")):
        return rest, None, transfer  # vLLM 0.32 renders a media chat whose features are not forwarded
    # bool is an int subclass, hence the exact type check (as vLLM's).
    if not isinstance(ids, list) or not ids or any(type(token) is not int or token < 0 for token in ids):
        raise invalid(FIELD, "must be a non-empty list of non-negative integers")
    if features is None:
        return rest, Forwarded(ids), transfer
    if not isinstance(features, dict):
        raise invalid(FEATURES_FIELD, "must be an object in vLLM's MultiModalFeatures shape")
    return rest, Forwarded(ids, parse_features(features, len(ids), FEATURES_FIELD)), transfer


def _has_media(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    return any(isinstance(part, dict) and part.get("type", "text") != "text"
               for message in messages if isinstance(message, dict)
               for part in (message.get("content") if isinstance(message.get("content"), list) else ()))


def chat_key(values: dict[str, Any]) -> str:
    """The chat body's digest, over what shapes render's answer."""
    kept = {key: value for key, value in values.items() if key not in NOT_IN_KEY}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _ids_key(key: str, ids) -> str:
    return key + ":" + hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


class RenderedChats:
    """Render answers by chat body and prompt ids, least recently used out first."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def put(self, key: str, rendered: render_pb2.RenderChatResponse) -> None:
        entry = _ids_key(key, rendered.generate_request.token_ids)
        kept = render_pb2.RenderChatResponse()
        kept.CopyFrom(rendered)
        kept.generate_request.ClearField("mm_features")  # a reuse brings its own (prompt_features)
        self._entries[entry] = kept.SerializeToString()
        self._entries.move_to_end(entry)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: str, ids) -> render_pb2.RenderChatResponse | None:
        """A copy of the answer kept for this chat and these ids, None when none is."""
        entry = _ids_key(key, ids)
        kept = self._entries.get(entry)
        if kept is None:
            return None
        self._entries.move_to_end(entry)
        return render_pb2.RenderChatResponse.FromString(kept)


def with_forwarded_ids(rendered: render_pb2.RenderChatResponse, ids, request_id: str
                       ) -> render_pb2.RenderChatResponse:
    """`rendered` running `ids` under `request_id`: the prompt tail and count derender seeds
    from are the forwarded prompt's."""
    request, context = rendered.generate_request, rendered.derender_context
    del request.token_ids[:]
    request.token_ids.extend(ids)
    request.request_id = context.request_id = request_id
    del context.prompt_tail_token_ids[:]
    context.prompt_tail_token_ids.extend(ids[-PROMPT_TAIL:])
    context.prompt_tokens = len(ids)
    return rendered
