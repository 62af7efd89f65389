"""Admission of `GenerateRequest.mm_features`: every rule checked before a request is scheduled.

Two phases, because the encoder cache lives in the engine core (a child process) while requests
arrive in the server process:

* `validate_structure(token_ids, features, spec, policy) -> CheckedFeatures` (rules 1-5, the
  server process, before anything is sent to the core; `validate_encode_structure` for Encode).
  Its result is picklable and is what the server sends the core.
* `resolve_cached(checked, cache) -> ValidatedFeatures` (rule 6, in the core at "add", before
  the request is scheduled). Its errors travel back to the caller unchanged (domain errors pickle whole).

`validate_mm_features(token_ids, features, spec, policy, cache)` runs both (Generate;
`validate_encode_request` is the same minus the prompt, for Encode). Together they turn the wire items into
`ValidatedItem`s the runner can use without further checks (decoded encoder inputs, integer
grid, absolute embed positions, and, when the encoder can be skipped, the cached encoder rows
already pinned), or raises a `tito.errors` exception naming the offending field, e.g.
`mm_features.items[2].placeholder.offset`. Nothing here imports grpc; the proto message types
are only read.

Rules, in the order they are checked (first violation wins):

1. Per item, structure: the modality is one the model supports; `mm_hash` is 16-128 lowercase
   hex digits; a placeholder range is present, non-empty, inside `token_ids`, after the previous
   item's range (sorted, no overlap); `len(is_embed) == length` when present.
2. Per item, tensors: every kwargs/metadata tensor has a known dtype and
   `len(data) == prod(shape) * itemsize` (tito.tensors.check); the item's bytes and the request's
   running total stay within `FeaturePolicy` limits (RESOURCE_EXHAUSTED naming the limit).
3. Per item, signature (see "Trust model").
4. Per item, model layout: only the tensor names the model knows; the metadata the model needs
   even without kwargs (Qwen2-VL: `image_grid_thw`, M-RoPE needs it; Qwen2.5-VL videos may add
   `second_per_grid_ts`, one positive float, default 1.0); the number of encoder output
   rows the item produces (Qwen2-VL: prod(grid_thw) // spatial_merge_size**2, Gemma3: fixed)
   equals its number of embed positions; for M-RoPE models the embed positions are one
   contiguous run (a Qwen3-VL video: one run per frame, the timestamp text between); when kwargs are present they have plausible shapes and dtypes (Qwen2-VL
   `pixel_values` [prod(grid_thw), C*T*P*P] floating point).
5. Token ids: every embed position holds the modality's placeholder token id, and no placeholder
   token id appears anywhere else (the ids and the features would disagree: HF models scatter
   encoder rows into *every* placeholder token, so a stray one would shift all rows).
6. Per item, resolution (the only step that touches the encoder cache): an EC descriptor must be
   this engine's own (store_id, uri, model_fingerprint), name exactly the item's cache key, and
   match the cached entry's checksum, dtype, shape and size; otherwise it is rejected as forged
   and never dereferenced. An item without kwargs needs a resolvable descriptor or a cache hit
   by its key, else FAILED_PRECONDITION `MM_TENSORS_REQUIRED` (re-render with mm_payload TENSORS).

Trust model
-----------
The encoder cache maps a key to encoder output; whoever can choose the key for an item can make
the engine serve (or poison) another request's output. So a cache key is only ever derived from
something bound to the item's content:

* Signing off (the engine has no keys; `require_signed_features` must then be off): the operator
  trusts every caller (e.g. only render and a router can reach the engine). `mm_hash` is used
  as the cache key as given, metadata-only items may hit, tags are ignored (there is no key to
  check them with).
* Keys configured, `require_signed_features` on: every item must carry a tag that verifies
  (`tito.signing.verify_item`: HMAC over hash, placeholder, tensors, metadata and EC descriptor).
  A verified `mm_hash` was computed by render from the media, so it keys the cache; metadata-only
  items may hit and descriptors may be honoured.
* Keys configured, not required: a present tag must verify (a bad tag is rejected, never
  ignored). A verified item is trusted as above. An unsigned item's `mm_hash` is NOT trusted: if
  it carries tensors, its cache key is a digest the engine computes itself over its tensors
  (`tensors-<sha256>`), so it can only hit (or fill) an entry for exactly the same encoder input;
  an unsigned item without tensors cannot claim a cache hit or use a descriptor at all
  (FAILED_PRECONDITION `MM_TENSORS_REQUIRED`).

EC descriptors are resolved only against this engine's own encoder cache for now; a descriptor
naming another store, another model, a key other than the item's cache key, or a checksum other
than the cached entry's is rejected (INVALID_ARGUMENT `EC_DESCRIPTOR_INVALID`) without being read.
A cache hit pins the entry's rows into the `ValidatedItem`, so a later eviction cannot make an
admitted request fail.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tito import signing, tensors
from tito.errors import FailedPrecondition, FieldViolation, InvalidArgument, ResourceExhausted, Unavailable
from tito.v1 import multimodal_pb2, tensor_pb2

from tito_engine.multimodal.encoder_cache import CacheEntry, CacheKey, EncoderCache
from tito_engine.multimodal.encoder_store import EntryCorrupt, EntryMissing, SharedEncoderStore
from tito_engine.multimodal.specs import TENSORS_REQUIRED, ItemLayout, ModelMultimodalSpec, tensor_path

_MM_HASH = re.compile(r"[0-9a-f]{16,128}")

MODALITY_NAMES: dict[int, str] = {
    multimodal_pb2.MODALITY_IMAGE: "image",
    multimodal_pb2.MODALITY_VIDEO: "video",
    multimodal_pb2.MODALITY_AUDIO: "audio",
}

SIGNATURE_INVALID = "MM_SIGNATURE_INVALID"
EC_DESCRIPTOR_INVALID = "EC_DESCRIPTOR_INVALID"
EC_DESCRIPTOR_STALE = "EC_DESCRIPTOR_STALE"
EC_ENTRY_EVICTED = "EC_ENTRY_EVICTED"
EC_MODEL_MISMATCH = "EC_MODEL_MISMATCH"
EC_ENTRY_CORRUPT = "EC_ENTRY_CORRUPT"
EC_STORE_UNAVAILABLE = "EC_STORE_UNAVAILABLE"


# ---------------------------------------------------------------------------- policy and results


@dataclass(frozen=True)
class FeaturePolicy:
    """The engine's configured limits and signing keys for media items."""

    max_item_bytes: int = 64 << 20
    max_request_bytes: int = 256 << 20
    max_items: int = 64
    signing_keys: Mapping[str, bytes] = field(default_factory=dict)  # auth_key_id -> key ("" = default)
    require_signed_features: bool = False

    def __post_init__(self) -> None:
        if self.require_signed_features and not self.signing_keys:
            raise ValueError("require_signed_features needs at least one signing key to verify tags with")

    @property
    def signing_enabled(self) -> bool:
        return bool(self.signing_keys)


@dataclass(frozen=True)
class ValidatedItem:
    """One admitted media item, ready for the runner."""

    index: int  # position in mm_features.items
    modality: str
    mm_hash: str
    offset: int
    length: int
    embed_positions: tuple[int, ...]  # absolute token indices that take encoder rows, ascending
    num_rows: int  # == len(embed_positions)
    grid_thw: tuple[int, int, int] | None  # M-RoPE grid (Qwen2-VL, Qwen2.5-VL), None otherwise
    # What identifies the item's content for every cache (encoder cache, prefix cache): mm_hash
    # when trusted, else the engine's own digest of its tensors. Key prefix-cache blocks that cover
    # the item by this, never by a client's unverified mm_hash (the token ids of two images are equal).
    content_id: str
    # Where its encoder output is cached or belongs: after encoding, the runner `put`s the rows here.
    # None: the engine keeps no cache (do not cache).
    cache_key: CacheKey | None
    signed: bool  # its auth_tag verified
    # Decoded encoder inputs (e.g. pixel_values, image_grid_thw); empty when `encoder_rows` is set.
    encoder_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Encoder output pinned from the cache (hit or EC descriptor); None: the runner must encode.
    encoder_rows: torch.Tensor | None = None
    # Qwen2.5-VL videos: seconds per temporal grid step (spaces M-RoPE's time axis); None elsewhere.
    second_per_grid_ts: float | None = None
    # The encoder output was loaded from the shared encoder store (a descriptor, or a key hit there).
    from_store: bool = False

    @property
    def needs_encoder(self) -> bool:
        return self.encoder_rows is None

    @property
    def is_embed(self) -> tuple[bool, ...]:
        positions = set(self.embed_positions)
        return tuple(self.offset + k in positions for k in range(self.length))


@dataclass(frozen=True)
class ValidatedFeatures:
    items: tuple[ValidatedItem, ...] = ()
    total_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def to_encode(self) -> tuple[ValidatedItem, ...]:
        return tuple(item for item in self.items if item.needs_encoder)


# ---------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class CheckedItem:
    """Phase-1 result for one item: every rule but cache resolution (picklable: it crosses the
    pipe from the server process to the engine core, where the encoder cache lives)."""

    item: multimodal_pb2.MultiModalItem
    path: str
    modality: str
    layout: ItemLayout
    embed_positions: tuple[int, ...]
    signed: bool
    trusted_hash: bool


@dataclass(frozen=True)
class CheckedFeatures:
    """Phase-1 result for a request: the items that passed every cache-independent rule."""

    items: tuple[CheckedItem, ...] = ()
    total_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)


def validate_structure(
    token_ids: Sequence[int],
    features: multimodal_pb2.MultiModalFeatures | None,
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
) -> CheckedFeatures:
    """Phase 1 of Generate admission (rules 1-5): everything that needs no encoder cache.

    Runs in the server process before a request is sent to the engine core (also for text-only
    requests: a stray placeholder token is rejected here). `token_ids` must already be
    validated (non-empty, inside the vocabulary).
    """
    items = list(features.items) if features is not None else []
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
        signed = _check_signature(item, policy, path)
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


def resolve_cached(checked: CheckedFeatures, cache: EncoderCache | None,
                   store: SharedEncoderStore | None = None) -> ValidatedFeatures:
    """Phase 2 (rule 6), where the encoder cache lives (the engine core): cache hits, EC
    descriptors (this engine's own, or the shared `store`'s), MM_TENSORS_REQUIRED; decodes the
    encoder inputs of the items still to encode. An output loaded from `store` goes into `cache`."""
    if store is not None and cache is None:
        raise ValueError("a shared encoder store needs an encoder cache to load into")
    return ValidatedFeatures(tuple(_resolve(c, index, cache, store) for index, c in enumerate(checked.items)),
                             checked.total_bytes)


def validate_mm_features(
    token_ids: Sequence[int],
    features: multimodal_pb2.MultiModalFeatures | None,
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
    cache: EncoderCache | None = None,
) -> ValidatedFeatures:
    """Check `features` against the prompt, the model and the policy; see the module docstring.

    Both phases in one call (`validate_structure` then `resolve_cached`). `cache` is the
    engine's encoder cache (None: the engine keeps none, so only items with kwargs are served).
    """
    if cache is not None and spec is not None and cache.model_fingerprint != spec.model_fingerprint:
        raise ValueError("the encoder cache belongs to another model fingerprint than the spec")
    return resolve_cached(validate_structure(token_ids, features, spec, policy), cache)


def validate_encode_structure(
    features: multimodal_pb2.MultiModalFeatures | None,
    spec: ModelMultimodalSpec | None,
    policy: FeaturePolicy,
) -> CheckedFeatures:
    """Phase 1 of Encode admission: the Generate rules that do not involve a prompt.

    Encode has no token ids, so placeholders are not checked (and `embed_positions` is empty).
    Every item must carry kwargs (FAILED_PRECONDITION `MM_TENSORS_REQUIRED` otherwise).
    """
    items = list(features.items) if features is not None else []
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
        signed = _check_signature(item, policy, path)
        modality_spec = spec.modalities[modality]
        modality_spec.check_names(item, path)
        layout = modality_spec.layout(item, path)
        modality_spec.check_encoder_inputs(item, layout, path)
        checked.append(CheckedItem(item, path, modality, layout, (), signed,
                                   trusted_hash=signed or not policy.signing_enabled))
    return CheckedFeatures(tuple(checked), total_bytes)


def check_encoder_cache_enabled(cache: EncoderCache | None) -> EncoderCache:
    if cache is None:
        raise FailedPrecondition("this engine keeps no encoder cache, so Encode has nowhere to store outputs",
                                 reason="ENCODER_CACHE_DISABLED")
    return cache


def validate_encode_request(
    features: multimodal_pb2.MultiModalFeatures | None,
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
    return resolve_cached(validate_encode_structure(features, spec, policy), cache)


def _check_modality(item, spec: ModelMultimodalSpec | None, path: str) -> str:
    name = MODALITY_NAMES.get(item.modality)
    supported = sorted(spec.modalities) if spec is not None else []
    if name is None or name not in supported:
        what = "an unspecified modality" if item.modality == multimodal_pb2.MODALITY_UNSPECIFIED else \
            f"{name or item.modality} input"
        raise InvalidArgument(f"{path}.modality: the model does not accept {what} (supported: "
                              f"{', '.join(supported) or 'none: the model is text-only'})",
                              reason="UNSUPPORTED_MODALITY", field=f"{path}.modality")
    return name


def _check_hash(item, path: str) -> None:
    if not _MM_HASH.fullmatch(item.mm_hash):
        shown = item.mm_hash if len(item.mm_hash) <= 40 else item.mm_hash[:40] + "..."
        raise InvalidArgument(f"{path}.mm_hash must be 16-128 lowercase hex digits (render's content hash), "
                              f"got {shown!r}", reason="MM_HASH_INVALID", field=f"{path}.mm_hash")


def _check_placeholder(item, num_tokens: int, previous_end: int, path: str) -> tuple[int, ...]:
    if not item.HasField("placeholder"):
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


def _check_item_count(items: list, policy: FeaturePolicy) -> None:
    if len(items) > policy.max_items:
        raise ResourceExhausted(f"mm_features has {len(items)} items; this engine accepts at most "
                                f"{policy.max_items} per request (--max-mm-items)", reason="MM_TOO_MANY_ITEMS",
                                field="mm_features.items")


def _check_tensors(item, policy: FeaturePolicy, bytes_so_far: int, path: str) -> int:
    item_bytes = 0
    for group in ("kwargs", "metadata"):
        for name, tensor in getattr(item, group).items():
            tensors.check(tensor, tensor_path(path, group, name))
            item_bytes += len(tensor.data)
    if item_bytes > policy.max_item_bytes:
        raise ResourceExhausted(f"{path} carries {item_bytes} tensor bytes; the limit per item is "
                                f"{policy.max_item_bytes} (--max-mm-item-bytes)", reason="MM_ITEM_TOO_LARGE", field=path,
                                metadata={"limit": "max_item_bytes", "value": str(policy.max_item_bytes)})
    if bytes_so_far + item_bytes > policy.max_request_bytes:
        raise ResourceExhausted(f"mm_features carries more than {policy.max_request_bytes} tensor bytes "
                                f"(--max-mm-request-bytes), reached at {path}", reason="MM_REQUEST_TOO_LARGE",
                                field="mm_features",
                                metadata={"limit": "max_request_bytes", "value": str(policy.max_request_bytes)})
    return item_bytes


def _check_signature(item, policy: FeaturePolicy, path: str) -> bool:
    """True when the item's tag verified. Without keys, tags cannot be checked and are ignored."""
    if not policy.signing_enabled:
        return False
    field_path = f"{path}.auth_tag"
    if not item.auth_tag:
        if policy.require_signed_features:
            raise InvalidArgument(f"{field_path} is empty, but this engine requires signed features: send the "
                                  f"request as render (configured with the shared key) produced it",
                                  reason=SIGNATURE_INVALID, field=field_path)
        return False
    if item.auth_key_id not in policy.signing_keys:
        raise InvalidArgument(f"{field_path}: the tag names key id {item.auth_key_id!r}, which this engine does "
                              f"not have", reason=SIGNATURE_INVALID, field=field_path)
    if not signing.verify_item(item, policy.signing_keys):
        raise InvalidArgument(f"{field_path} does not verify: the item was changed after render signed it, or "
                              f"was signed with another key (an EC descriptor added after render signed the item "
                              f"must carry the encoding engine's own auth_tag)", reason=SIGNATURE_INVALID,
                              field=field_path)
    if item.HasField("ec_descriptor") and item.ec_descriptor.auth_tag \
            and not signing.verify_descriptor(item.ec_descriptor, policy.signing_keys):
        raise _forged(path, "auth_tag", "the descriptor's tag does not verify: it was changed after the encoding "
                                        "engine signed it, or signed with a key this engine does not have")
    return True


def _check_embed_layout(item, modality_spec, layout: ItemLayout, embed_positions: tuple[int, ...], path: str) -> None:
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


def content_digest(item: multimodal_pb2.MultiModalItem) -> str:
    """`tensors-<sha256>` over the item's modality and tensors: a cache key the engine computes itself."""
    digest = hashlib.sha256(b"tito.engine.encoder-input\x00")
    digest.update(struct.pack("<I", item.modality))
    for group in ("kwargs", "metadata"):
        tensors_by_name = getattr(item, group)
        digest.update(group.encode() + struct.pack("<Q", len(tensors_by_name)))
        for name in sorted(tensors_by_name):
            tensor = tensors_by_name[name]
            digest.update(struct.pack("<Q", len(name)) + name.encode())
            digest.update(struct.pack("<IQ", tensor.dtype, len(tensor.shape)))
            digest.update(struct.pack(f"<{len(tensor.shape)}q", *tensor.shape))
            digest.update(struct.pack("<Q", len(tensor.data)) + tensor.data)
    return f"tensors-{digest.hexdigest()}"


def _content_id(c: CheckedItem) -> str | None:
    """The identity of the item's content the engine may rely on (see "Trust model")."""
    if c.trusted_hash:
        return c.item.mm_hash
    if c.item.kwargs:
        return content_digest(c.item)
    return None


def _resolve(c: CheckedItem, index: int, cache: EncoderCache | None,
             store: SharedEncoderStore | None = None) -> ValidatedItem:
    item, path = c.item, c.path
    content_id = _content_id(c)
    key = cache.key_for(content_id) if cache is not None and content_id is not None else None
    entry: CacheEntry | None = None
    from_store = False
    if item.HasField("ec_descriptor"):
        if store is not None and item.ec_descriptor.store_id == store.store_id:
            entry, from_store = _resolve_shared_descriptor(c, key, cache, store)
        else:
            entry = _resolve_descriptor(c, key, cache, store)
    elif key is not None:
        entry = cache.get(key)
        if entry is None and store is not None:  # another engine may have encoded it: the shared store
            entry = _load_from_store(c, key, cache, store, quiet=True)
            from_store = entry is not None
    if entry is None and not item.kwargs:
        if not c.trusted_hash:
            why = ("it is unsigned, and this engine only lets signed items (or items with tensors) use its "
                   "encoder cache")
        elif item.HasField("ec_descriptor"):
            why = "its EC descriptor's entry is no longer in this engine's encoder cache"
        else:
            why = "its encoder output is not in this engine's encoder cache" + (
                " nor in the shared encoder store" if store is not None else "")
        raise FailedPrecondition(f"{path} has no kwargs (tensors) and {why}; re-render the request with "
                                 f"mm_payload TENSORS", reason=TENSORS_REQUIRED, field=f"{path}.kwargs")
    if entry is not None and (entry.rows.ndim != 2 or entry.rows.shape[0] != c.layout.num_rows):
        raise InvalidArgument(f"{path}: the cached encoder output for this item has shape {list(entry.shape)}, "
                              f"but its metadata says {c.layout.num_rows} rows; the hash and metadata disagree",
                              reason="MM_METADATA_MISMATCH", field=f"{path}.metadata")
    encoder_inputs: dict[str, torch.Tensor] = {}
    if entry is None:
        for name, tensor in item.kwargs.items():
            encoder_inputs[name] = tensors.to_torch(tensor, tensor_path(path, "kwargs", name))
    return ValidatedItem(
        index=index, modality=c.modality, mm_hash=item.mm_hash, offset=item.placeholder.offset,
        length=item.placeholder.length, embed_positions=c.embed_positions, num_rows=c.layout.num_rows,
        grid_thw=c.layout.grid_thw, second_per_grid_ts=c.layout.second_per_grid_ts, content_id=content_id,
        cache_key=key, signed=c.signed,
        encoder_inputs=encoder_inputs,
        encoder_rows=entry.rows if entry is not None else None, from_store=from_store)


def _forged(path: str, part: str, message: str) -> InvalidArgument:
    field_path = f"{path}.ec_descriptor.{part}"
    return InvalidArgument(f"{field_path}: {message}; the descriptor was not used", reason=EC_DESCRIPTOR_INVALID,
                           field=field_path)


def _resolve_descriptor(c: CheckedItem, key: CacheKey | None, cache: EncoderCache | None,
                        store: SharedEncoderStore | None = None) -> CacheEntry | None:
    """The cached entry a descriptor names, after checking every claim it makes (never trusting it)."""
    ec, path = c.item.ec_descriptor, c.path
    if cache is None or ec.store_id != cache.store_id:
        ours = repr(cache.store_id) if cache is not None else "none (this engine keeps no encoder cache)"
        shared = (f" or the shared encoder store ({store.store_id!r})" if store is not None else
                  "; a descriptor of a shared store (ecdir-...) needs --encoder-store-dir on the same directory "
                  "as the engine that answered Encode")
        raise _forged(path, "store_id", f"store {ec.store_id!r} is not this engine's encoder cache ({ours}){shared}")
    if ec.uri != cache.uri:
        raise _forged(path, "uri", f"uri {ec.uri!r} does not match this engine's store ({cache.uri!r})")
    if ec.model_fingerprint != cache.model_fingerprint:
        raise _forged(path, "model_fingerprint", f"output of model {ec.model_fingerprint!r} cannot be used by "
                                                 f"model {cache.model_fingerprint!r}")
    if key is None:
        return None  # an untrusted metadata-only item: the caller reports MM_TENSORS_REQUIRED
    if ec.key != key.text:
        raise _forged(path, "key", f"key {ec.key!r} is not this item's cache key {key.text!r} (it must name the "
                                   f"item's own content)")
    entry = cache.get(key)
    if entry is None:
        return None  # evicted since: honest, not forged; fall back to the kwargs if any
    if ec.checksum != entry.checksum:
        raise _forged(path, "checksum", "checksum does not match the cached entry's")
    if ec.dtype != entry.dtype or tuple(ec.shape) != entry.shape or ec.byte_size != entry.byte_size:
        raise _forged(path, "shape", f"dtype/shape/byte_size ({ec.dtype}, "
                                     f"{list(ec.shape)}, {ec.byte_size}) do not match the cached entry's")
    return entry


def _resolve_shared_descriptor(c: CheckedItem, key: CacheKey | None, cache: EncoderCache,
                               store: SharedEncoderStore) -> tuple[CacheEntry | None, bool]:
    """(entry, loaded from the store) for a descriptor of the shared encoder store, after checking
    every claim it makes against the store's own file: forged (EC_DESCRIPTOR_INVALID), another
    model (EC_MODEL_MISMATCH), stale (EC_DESCRIPTOR_STALE), evicted (EC_ENTRY_EVICTED) or
    tampered on disk (EC_ENTRY_CORRUPT). An item that still carries kwargs is encoded instead of
    refused when the store cannot serve it (evicted, stale, corrupt)."""
    ec, path = c.item.ec_descriptor, c.path
    if ec.uri != store.uri:
        raise _forged(path, "uri", f"uri {ec.uri!r} does not match the shared encoder store's ({store.uri!r})")
    if ec.model_fingerprint != store.model_fingerprint:
        field_path = f"{path}.ec_descriptor.model_fingerprint"
        raise InvalidArgument(f"{field_path}: the descriptor holds the encoder output of model "
                              f"{ec.model_fingerprint!r}, and this engine serves {store.model_fingerprint!r}; call "
                              f"Encode on an engine of this model", reason=EC_MODEL_MISMATCH, field=field_path)
    if key is None:
        return None, False  # an untrusted metadata-only item: the caller reports MM_TENSORS_REQUIRED
    if ec.key != key.text:
        raise _forged(path, "key", f"key {ec.key!r} is not this item's cache key {key.text!r} (it must name the "
                                   f"item's own content)")
    entry = cache.get(key)
    if entry is not None and entry.checksum == ec.checksum:
        _check_descriptor_fields(ec, entry, path)
        return entry, False
    entry = _load_from_store(c, key, cache, store, quiet=False, expected=ec)
    return entry, entry is not None


def _check_descriptor_fields(ec, entry: CacheEntry, path: str) -> None:
    if ec.dtype != entry.dtype or tuple(ec.shape) != entry.shape or ec.byte_size != entry.byte_size:
        raise _forged(path, "shape", f"dtype/shape/byte_size ({ec.dtype}, {list(ec.shape)}, {ec.byte_size}) do "
                                     f"not match the stored entry's")


def _load_from_store(c: CheckedItem, key: CacheKey, cache: EncoderCache, store: SharedEncoderStore, *,
                     quiet: bool, expected=None) -> CacheEntry | None:
    """The store's entry for `key`, loaded into `cache`. `quiet` (a lookup by key, no descriptor):
    None when the store cannot serve it. With a descriptor (`expected`): its refusal, unless the
    item carries kwargs to encode instead (None then)."""
    path = c.path
    field_path = f"{path}.ec_descriptor"
    fallback = quiet or bool(c.item.kwargs)
    try:
        header, data = store.get(key.text)
    except EntryMissing:
        if fallback:
            return None
        raise FailedPrecondition(f"{field_path}: the shared encoder store no longer holds this entry (evicted, or "
                                 f"never written there); call Encode again, or resend the item with mm_payload "
                                 f"TENSORS", reason=EC_ENTRY_EVICTED, field=field_path) from None
    except EntryCorrupt as exc:
        if fallback:
            return None
        raise FailedPrecondition(f"{field_path}: {exc}; call Encode again, or resend the item with mm_payload "
                                 f"TENSORS", reason=EC_ENTRY_CORRUPT, field=field_path) from None
    except OSError as exc:
        raise Unavailable(f"the shared encoder store cannot be read ({exc.strerror or exc}); resend the item with "
                          f"mm_payload TENSORS or retry on another replica", reason=EC_STORE_UNAVAILABLE) from None
    if expected is not None:
        if header.checksum != expected.checksum:
            if fallback:
                return None
            raise FailedPrecondition(f"{field_path}.checksum: the shared encoder store's entry for this key is not "
                                     f"the one the descriptor describes (re-encoded or rewritten since it was "
                                     f"issued); call Encode again", reason=EC_DESCRIPTOR_STALE,
                                     field=f"{field_path}.checksum")
        if expected.dtype != header.dtype or tuple(expected.shape) != header.shape \
                or expected.byte_size != header.byte_size:
            raise _forged(path, "shape", f"dtype/shape/byte_size ({expected.dtype}, {list(expected.shape)}, "
                                         f"{expected.byte_size}) do not match the stored entry's")
    if len(header.shape) != 2 or header.shape[0] != c.layout.num_rows:
        raise InvalidArgument(f"{path}: the stored encoder output for this item has shape {list(header.shape)}, "
                              f"but its metadata says {c.layout.num_rows} rows; the hash and metadata disagree",
                              reason="MM_METADATA_MISMATCH", field=f"{path}.metadata")
    rows = tensors.to_torch(tensor_pb2.Tensor(dtype=header.dtype, shape=list(header.shape), data=data),
                            field_path).clone()
    return cache.put_verified(key, rows, checksum=header.checksum, dtype=header.dtype, byte_size=header.byte_size)
