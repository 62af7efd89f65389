"""Admission of `GenerateRequest.mm_features`: every rule checked before a request is scheduled.

Two phases, because the encoder cache lives in the engine core (a child process) while requests
arrive in the server process:

* `validate_structure(token_ids, items, spec, policy) -> CheckedFeatures` (rules 1-5, the
  server process, before anything is sent to the core; `validate_encode_structure` for Encode).
  Its result is picklable and is what the server sends the core.
* `resolve_cached(checked, cache) -> ValidatedFeatures` (rule 6, in the core at "add", before
  the request is scheduled). Its errors travel back to the caller unchanged (domain errors pickle whole).

`validate_mm_features(token_ids, items, spec, policy, cache)` runs both (Generate;
`validate_encode_request` is the same minus the prompt, for Encode). Together they turn the wire items into
`ValidatedItem`s the runner can use without further checks (decoded encoder inputs, integer
grid, absolute embed positions, and, when the encoder can be skipped, the cached encoder rows
already pinned), or raises a `tito.errors` exception naming the offending field, e.g.
`mm_features.items[2].placeholder.offset`. The items are the servicer's `domain.MediaItem`s
(service/convert.py made them from the wire message, unchecked); nothing here reads a message.

Rules, in the order they are checked (first violation wins):

1. Per item, structure: the modality is one the model supports; `mm_hash` is 16-128 lowercase
   hex digits; a placeholder range is present, non-empty, inside `token_ids`, after the previous
   item's range (sorted, no overlap); `len(is_embed) == length` when present.
2. Per item, tensors: every kwargs/metadata tensor has a known dtype, at most 64 dimensions and
   `len(data) == prod(shape) * itemsize` (tito.tensors.check); the item's bytes and the request's
   running total stay within `FeaturePolicy` limits (RESOURCE_EXHAUSTED naming the limit).
3. Per item, signature (see "Trust model").
4. Per item, model layout: only the tensor names the model knows; the metadata the model needs
   even without kwargs (Qwen2-VL: `image_grid_thw`, M-RoPE needs it; Qwen2.5-VL videos may add
   `second_per_grid_ts`, one positive float, default 1.0); the number of encoder output
   rows the item produces (Qwen2-VL: prod(grid_thw) // spatial_merge_size**2, Gemma3: fixed)
   equals its number of embed positions; for M-RoPE models the embed positions are one
   contiguous run (a Qwen3-VL video: one run per frame, the timestamp text between); when kwargs
   are present they have plausible shapes and dtypes (Qwen2-VL
   `pixel_values` [prod(grid_thw), C*T*P*P] floating point).
5. Token ids: every embed position holds the modality's placeholder token id, and no placeholder
   token id appears anywhere else (the ids and the features would disagree: HF models scatter
   encoder rows into *every* placeholder token, so a stray one would shift all rows).
6. Per item, resolution (the only step that touches the encoder cache and the shared store;
   resolution.py): an EC descriptor must be this engine's own or its shared store's (store_id,
   uri, model_fingerprint), name exactly the item's cache key, and match the entry's checksum,
   dtype, shape and size; otherwise it is refused (see trust.py) and never dereferenced. An
   item without kwargs needs a resolvable descriptor or a cache hit
   by its key, else FAILED_PRECONDITION `MM_TENSORS_REQUIRED` (re-render with mm_payload TENSORS).

The trust model (which `mm_hash` may key the encoder cache) is `trust.py`'s docstring; rule 6
is `resolution.py`; the result types are `items.py`. This module re-exports them, so its
callers import one name from one place.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tito import tensors
from tito.errors import FailedPrecondition, FieldViolation, InvalidArgument, ResourceExhausted
from tito_engine.multimodal.domain import MediaItem
from tito_engine.multimodal.encoder_cache import EncoderCache
from tito_engine.multimodal.items import (EC_DESCRIPTOR_INVALID, EC_DESCRIPTOR_STALE, EC_ENTRY_CORRUPT,  # noqa: F401
                                          EC_ENTRY_EVICTED, EC_MODEL_MISMATCH, EC_STORE_UNAVAILABLE, MODALITY_NAMES,
                                          MODALITY_UNSPECIFIED, SIGNATURE_INVALID, CheckedFeatures, CheckedItem,
                                          FeaturePolicy, ValidatedFeatures, ValidatedItem)
from tito_engine.multimodal.resolution import check_encoder_cache_enabled, resolve_cached
from tito_engine.multimodal.specs import TENSORS_REQUIRED, ItemLayout, ModelMultimodalSpec, tensor_path  # noqa: F401
from tito_engine.multimodal.trust import check_signature, content_digest, item_content_id  # noqa: F401

_MM_HASH = re.compile(r"[0-9a-f]{16,128}")


def validate_structure(
    token_ids: Sequence[int],
    items: Sequence[MediaItem],
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
) -> CheckedFeatures:
    """Phase 1 of Generate admission (rules 1-5): everything that needs no encoder cache.

    Runs in the server process before a request is sent to the engine core (also for text-only
    requests: a stray placeholder token is rejected here). `token_ids` must already be
    validated (non-empty, inside the vocabulary).
    """
    _check_item_count(items, policy)
    checked: list[CheckedItem] = []
    total_bytes = 0
    previous_end = 0
    for index, item in enumerate(items):
        path = f"mm_features.items[{index}]"
        modality = _check_modality(item, spec, path)
        _check_hash(item, path)
        embed_positions = _check_placeholder(item, len(token_ids), previous_end, path)
        previous_end = item.placeholder.offset + item.placeholder.length
        total_bytes += _check_tensors(item, policy, total_bytes, path)
        signed = check_signature(item, policy, path)
        modality_spec = spec.modalities[modality]
        modality_spec.check_names(item, path)
        layout = modality_spec.layout(item, path)
        _check_embed_layout(item, modality_spec, layout, embed_positions, path)
        if item.kwargs:
            modality_spec.check_encoder_inputs(item, layout, path)
        _check_placeholder_tokens(token_ids, modality_spec, embed_positions, path)
        checked.append(CheckedItem(item, path, modality, layout, embed_positions, signed,
                                   trusted_hash=signed or not policy.signing_enabled))
    if spec is not None:
        _check_unclaimed_placeholders(token_ids, spec, checked)
    return CheckedFeatures(tuple(checked), total_bytes)


def validate_mm_features(
    token_ids: Sequence[int],
    items: Sequence[MediaItem],
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
    cache: EncoderCache | None = None,
) -> ValidatedFeatures:
    """Check `items` against the prompt, the model and the policy; see the module docstring.

    Both phases in one call (`validate_structure` then `resolve_cached`). `cache` is the
    engine's encoder cache (None: the engine keeps none, so only items with kwargs are served).
    """
    if cache is not None and spec is not None and cache.model_fingerprint != spec.model_fingerprint:
        raise ValueError("the encoder cache belongs to another model fingerprint than the spec")
    return resolve_cached(validate_structure(token_ids, items, spec, policy), cache)


def validate_encode_structure(
    items: Sequence[MediaItem],
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
) -> CheckedFeatures:
    """Phase 1 of Encode admission: the Generate rules that do not involve a prompt.

    Encode has no token ids, so placeholders are not checked and may be absent (`embed_positions`
    is empty).
    Every item must carry kwargs (FAILED_PRECONDITION `MM_TENSORS_REQUIRED` otherwise).
    """
    if not items:
        raise InvalidArgument("mm_features.items must not be empty: nothing to encode", reason="MM_ITEMS_EMPTY",
                              field="mm_features.items")
    _check_item_count(items, policy)
    checked: list[CheckedItem] = []
    total_bytes = 0
    for index, item in enumerate(items):
        path = f"mm_features.items[{index}]"
        modality = _check_modality(item, spec, path)
        _check_hash(item, path)
        if not item.kwargs:
            raise FailedPrecondition(f"{path}.kwargs is empty: Encode needs the encoder inputs; render the item "
                                     f"with mm_payload TENSORS", reason=TENSORS_REQUIRED, field=f"{path}.kwargs")
        total_bytes += _check_tensors(item, policy, total_bytes, path)
        signed = check_signature(item, policy, path)
        modality_spec = spec.modalities[modality]
        modality_spec.check_names(item, path)
        layout = modality_spec.layout(item, path)
        modality_spec.check_encoder_inputs(item, layout, path)
        checked.append(CheckedItem(item, path, modality, layout, (), signed,
                                   trusted_hash=signed or not policy.signing_enabled))
    return CheckedFeatures(tuple(checked), total_bytes)


def validate_encode_request(
    items: Sequence[MediaItem],
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
    cache: EncoderCache | None,
) -> ValidatedFeatures:
    """Admission for the Encode RPC (both phases): `validate_encode_structure`, then resolution.

    The engine must keep an encoder cache to put the outputs in. Items already cached come back
    with `encoder_rows` set; the caller encodes `to_encode`, `cache.put`s each output under the
    item's `cache_key` and answers `cache.descriptor_for(item.cache_key)` per item.
    """
    check_encoder_cache_enabled(cache)
    return resolve_cached(validate_encode_structure(items, spec, policy), cache)


def _check_modality(item: MediaItem, spec: ModelMultimodalSpec | None, path: str) -> str:
    name = MODALITY_NAMES.get(item.modality)
    supported = sorted(spec.modalities) if spec is not None else []
    if name is None or name not in supported:
        what = "an unspecified modality" if item.modality == MODALITY_UNSPECIFIED else \
            f"{name or item.modality} input"
        raise InvalidArgument(f"{path}.modality: the model does not accept {what} (supported: "
                              f"{', '.join(supported) or 'none: the model is text-only'})",
                              reason="UNSUPPORTED_MODALITY", field=f"{path}.modality")
    return name


def _check_hash(item: MediaItem, path: str) -> None:
    if not _MM_HASH.fullmatch(item.mm_hash):
        shown = item.mm_hash if len(item.mm_hash) <= 40 else item.mm_hash[:40] + "..."
        raise InvalidArgument(f"{path}.mm_hash must be 16-128 lowercase hex digits (render's content hash), "
                              f"got {shown!r}", reason="MM_HASH_INVALID", field=f"{path}.mm_hash")


def _check_placeholder(item: MediaItem, num_tokens: int, previous_end: int, path: str) -> tuple[int, ...]:
    if item.placeholder is None:
        raise InvalidArgument(f"{path}.placeholder is required: where the item's tokens are in token_ids",
                              reason="MM_PLACEHOLDER_MISSING", field=f"{path}.placeholder")
    offset, length, is_embed = item.placeholder.offset, item.placeholder.length, item.placeholder.is_embed
    if length == 0:
        raise InvalidArgument(f"{path}.placeholder.length must be > 0", reason="MM_PLACEHOLDER_EMPTY",
                              field=f"{path}.placeholder.length")
    if offset >= num_tokens:
        raise InvalidArgument(f"{path}.placeholder.offset {offset} is outside token_ids (length {num_tokens})",
                              reason="MM_PLACEHOLDER_OUT_OF_RANGE", field=f"{path}.placeholder.offset")
    if offset + length > num_tokens:
        raise InvalidArgument(f"{path}.placeholder [{offset}, {offset + length}) runs past the end of token_ids "
                              f"(length {num_tokens})", reason="MM_PLACEHOLDER_OUT_OF_RANGE",
                              field=f"{path}.placeholder.length")
    if offset < previous_end:
        raise InvalidArgument(f"{path}.placeholder.offset {offset} overlaps or precedes the previous item's range "
                              f"(which ends at {previous_end}); items must be sorted by offset and must not "
                              f"overlap", reason="MM_PLACEHOLDER_OVERLAP", field=f"{path}.placeholder.offset")
    if is_embed and len(is_embed) != length:
        raise InvalidArgument(f"{path}.placeholder.is_embed has {len(is_embed)} entries; it needs exactly "
                              f"length = {length} (or none)", reason="MM_IS_EMBED_LENGTH_MISMATCH",
                              field=f"{path}.placeholder.is_embed")
    if not is_embed:
        return tuple(range(offset, offset + length))
    return tuple(offset + k for k, flag in enumerate(is_embed) if flag)


def _check_item_count(items: Sequence[MediaItem], policy: FeaturePolicy) -> None:
    if len(items) > policy.max_items:
        raise ResourceExhausted(f"mm_features has {len(items)} items; this engine accepts at most "
                                f"{policy.max_items} per request (--max-mm-items)", reason="MM_TOO_MANY_ITEMS",
                                field="mm_features.items")


def _check_tensors(item: MediaItem, policy: FeaturePolicy, bytes_so_far: int, path: str) -> int:
    item_bytes = 0
    for group in ("kwargs", "metadata"):
        for name, tensor in getattr(item, group).items():
            tensors.check(tensor, tensor_path(path, group, name))
            item_bytes += len(tensor.data)
    if item_bytes > policy.max_item_bytes:
        raise ResourceExhausted(f"{path} carries {item_bytes} tensor bytes; the limit per item is "
                                f"{policy.max_item_bytes} (--max-mm-item-bytes)",
                                reason="MM_ITEM_TOO_LARGE", field=path,
                                metadata={"limit": "max_item_bytes", "value": str(policy.max_item_bytes)})
    if bytes_so_far + item_bytes > policy.max_request_bytes:
        raise ResourceExhausted(f"mm_features carries more than {policy.max_request_bytes} tensor bytes "
                                f"(--max-mm-request-bytes), reached at {path}", reason="MM_REQUEST_TOO_LARGE",
                                field="mm_features",
                                metadata={"limit": "max_request_bytes", "value": str(policy.max_request_bytes)})
    return item_bytes


def _check_embed_layout(item: MediaItem, modality_spec, layout: ItemLayout, embed_positions: tuple[int, ...],
                        path: str) -> None:
    field_path = f"{path}.placeholder.is_embed" if item.placeholder.is_embed else f"{path}.placeholder.length"
    if len(embed_positions) != layout.num_rows:
        grid = f" (grid_thw {list(layout.grid_thw)})" if layout.grid_thw else ""
        raise InvalidArgument(f"{path} has {len(embed_positions)} embed positions but its encoder output has "
                              f"{layout.num_rows} rows{grid}; the placeholder and the tensors disagree",
                              reason="MM_EMBED_COUNT_MISMATCH", field=field_path)
    if modality_spec.contiguous_embeds and embed_positions[-1] - embed_positions[0] + 1 != len(embed_positions):
        raise InvalidArgument(f"{path}.placeholder.is_embed: this model's positions (M-RoPE) need the embed "
                              f"positions to form one contiguous run", reason="MM_EMBEDS_NOT_CONTIGUOUS",
                              field=f"{path}.placeholder.is_embed")
    if getattr(modality_spec, "runs_per_frame", False) and layout.grid_thw is not None:
        frames = layout.grid_thw[0]
        per_frame = len(embed_positions) // frames
        for frame in range(frames):
            run = embed_positions[frame * per_frame:(frame + 1) * per_frame]
            if run[-1] - run[0] + 1 != per_frame:
                raise InvalidArgument(f"{path}.placeholder.is_embed: this model's positions (M-RoPE) need the "
                                      f"embed positions of each of the {frames} frames to form one contiguous run "
                                      f"of {per_frame}; frame {frame}'s does not", reason="MM_EMBEDS_NOT_CONTIGUOUS",
                                      field=f"{path}.placeholder.is_embed")


def _check_placeholder_tokens(token_ids: Sequence[int], modality_spec, embed_positions, path: str) -> None:
    expected = modality_spec.placeholder_token_id
    for position in embed_positions:
        if token_ids[position] != expected:
            message = (f"{path}: token_ids[{position}] is {token_ids[position]}, but every embed position of a "
                       f"{modality_spec.modality} item must hold its placeholder token id {expected}; the token "
                       f"ids and the features disagree")
            raise InvalidArgument(message, reason="MM_PLACEHOLDER_TOKEN_MISMATCH", field=f"{path}.placeholder",
                                  violations=[FieldViolation(f"token_ids[{position}]", message)])


def _check_unclaimed_placeholders(token_ids: Sequence[int], spec: ModelMultimodalSpec,
                                  checked: list[CheckedItem]) -> None:
    placeholder_ids = spec.placeholder_token_ids
    claimed = {position for c in checked for position in c.embed_positions}
    for position, token_id in enumerate(token_ids):
        if token_id in placeholder_ids and position not in claimed:
            raise InvalidArgument(
                f"token_ids[{position}] is the {placeholder_ids[token_id]} placeholder token {token_id} but no "
                f"mm_features item claims that position; the token ids and the features disagree",
                reason="MM_PLACEHOLDER_UNCLAIMED", field=f"token_ids[{position}]")
