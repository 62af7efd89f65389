"""Media on `/inference/v1/generate` without a render answer in the body: vLLM's `content_parts`
(the server renders the media) and hashes-only `features` (items the engine holds).

Domain code: no HTTP here. The gateway has no processor of its own, so `content_parts` are
rendered by render, as a one-message chat holding just those parts, and the items render
returns (hash, tensors, metadata, `is_embed`) are placed in the caller's `token_ids`:

- an item's placeholder span as render expanded it (what tito's and vLLM's render endpoints
  return) is found in `token_ids`, in order, and the item points at it;
- where `token_ids` hold the model's unexpanded marker instead (one placeholder token where the
  span repeats that one token, as a chat template writes it), the marker is expanded to the
  span, as vLLM's processor expands a token prompt;
- anything else (a missing span, items out of order) is a 400 naming `content_parts`.

An item moved to another offset loses render's signature (it covers the placeholder): an engine
that requires signed features refuses it, which is the point of signing.

Hashes-only `features` (vLLM's METADATA-less shape) need the small per-item metadata tito's
engine takes even without tensors (Qwen2-VL's `image_grid_thw`, for M-RoPE): `KeptMetadata`
keeps it by `mm_hash` for every item render gave this gateway, so an item rendered or run here
before is sent as tito's METADATA path (hash, placeholder, metadata) and the engine serves it
from its encoder cache."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tito.v1 import multimodal_pb2
from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported

FIELD = "content_parts"
#: vLLM's content part types; the gateway's chats carry images only.
PART_TYPES = ("image_url", "audio_url", "video_url")
#: A field of the one-message chat's parts, as render (or the gateway's chat parser) names it.
RENDER_PART = re.compile(r"^messages\[0\]\.content(?:_parts)?(\[\d+\])(.*)$")
#: Items whose metadata is kept (a Qwen2-VL item's is 24 bytes).
MAX_KEPT_ITEMS = 4096


def chat_parts(parts: Any) -> list[dict]:
    """vLLM's `content_parts` -> the OpenAI content parts of the chat render renders them in."""
    if not isinstance(parts, list) or not parts:
        raise invalid(FIELD, "must be a non-empty array of content parts")
    out = []
    for index, part in enumerate(parts):
        where = f"{FIELD}[{index}]"
        if not isinstance(part, dict):
            raise invalid(where, "must be a content part object")
        for key in part:
            if key not in ("type", "url", "uuid"):
                raise unsupported(f"{where}.{key[:64]}", "unknown field of a content part (type, url, uuid)")
        kind = openai_in._string(part.get("type"), f"{where}.type", True)
        if kind not in PART_TYPES:
            raise invalid(f"{where}.type", f"must be one of {', '.join(PART_TYPES)}")
        if kind != "image_url":
            raise unsupported(f"{where}.type", "only image_url parts are supported on this gateway")
        if part.get("uuid") is not None:
            raise unsupported(f"{where}.uuid", "tito keys media by the content hash render computes; leave uuid "
                                               "null")
        url = openai_in._string(part.get("url"), f"{where}.url", True)
        out.append({"type": "image_url", "image_url": {"url": url}})
    return out


def render_param(param: str | None) -> str | None:
    """A field render named in the one-message chat (`messages[0].content_parts[i].image`), as
    the content part it came from (`content_parts[i].url`)."""
    match = RENDER_PART.match(param or "")
    if match is None:
        return param
    index, rest = match.groups()
    return f"{FIELD}{index}" + (".url" if rest.startswith((".image", ".url")) else rest)


Item = multimodal_pb2.MultiModalItem


def place_items(token_ids: Sequence[int], rendered_ids: Sequence[int],
                items: Sequence[Item]) -> tuple[list[int], list[Item]]:
    """The prompt the engine runs and render's `items` placed in it (see the module's docstring)."""
    spans = [list(rendered_ids[item.placeholder.offset:item.placeholder.offset + item.placeholder.length])
             for item in items]
    offsets = _find_spans(token_ids, spans)
    ids = list(token_ids)
    if offsets is None:
        ids, offsets = _expand_markers(token_ids, spans)
    placed = []
    for item, offset in zip(items, offsets):
        moved = multimodal_pb2.MultiModalItem()
        moved.CopyFrom(item)
        if offset != item.placeholder.offset:
            moved.placeholder.offset = offset
            moved.ClearField("auth_tag")  # render's tag covers the placeholder it gave
            moved.ClearField("auth_key_id")
        placed.append(moved)
    return ids, placed


def _find_spans(token_ids: Sequence[int], spans: list[list[int]]) -> list[int] | None:
    offsets, start = [], 0
    for span in spans:
        offset = _index_of(token_ids, span, start)
        if offset is None:
            return None
        offsets.append(offset)
        start = offset + len(span)
    return offsets


def _expand_markers(token_ids: Sequence[int], spans: list[list[int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    offsets: list[int] = []
    start = 0
    for index, span in enumerate(spans):
        marker = span[0]
        found = _index_of(token_ids, [marker], start) if len(set(span)) == 1 else None
        if found is None:
            raise invalid(FIELD, f"token_ids hold no placeholder for content_parts[{index}]: send the token ids a "
                                 f"render endpoint returned for the same media (or the template's one-token "
                                 f"marker), in the parts' order")
        ids.extend(token_ids[start:found])
        offsets.append(len(ids))
        ids.extend(span)
        start = found + 1
    ids.extend(token_ids[start:])
    return ids, offsets


def _index_of(token_ids: Sequence[int], span: list[int], start: int) -> int | None:
    if not span:
        return None
    first, length = span[0], len(span)
    for index in range(start, len(token_ids) - length + 1):
        if token_ids[index] == first and list(token_ids[index:index + length]) == span:
            return index
    return None


class KeptMetadata:
    """Items' metadata by `mm_hash` (least recently used out first), from render's answers."""

    def __init__(self, max_items: int = MAX_KEPT_ITEMS) -> None:
        self.max_items = max_items
        self._by_hash: OrderedDict[str, bytes] = OrderedDict()

    def keep(self, items: Sequence[multimodal_pb2.MultiModalItem]) -> None:
        for item in items:
            if not item.metadata:
                continue
            only = multimodal_pb2.MultiModalItem(metadata=item.metadata)
            self._by_hash[item.mm_hash] = only.SerializeToString()
            self._by_hash.move_to_end(item.mm_hash)
        while len(self._by_hash) > self.max_items:
            self._by_hash.popitem(last=False)

    def fill(self, items: Sequence[multimodal_pb2.MultiModalItem]) -> None:
        """Give every item without tensors or metadata the metadata kept for its hash, if any."""
        for item in items:
            if item.kwargs or item.metadata:
                continue
            kept = self._by_hash.get(item.mm_hash)
            if kept is not None:
                self._by_hash.move_to_end(item.mm_hash)
                item.metadata.MergeFrom(multimodal_pb2.MultiModalItem.FromString(kept).metadata)
