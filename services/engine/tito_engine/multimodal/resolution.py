"""Rule 6 of admission, where the encoder cache lives (the engine core): cache hits, EC
descriptors (this engine's own, or a shared store's), and MM_TENSORS_REQUIRED for a metadata-only
item nothing can serve. See features.py for rules 1-5 and trust.py for which keys are trusted.
"""

from __future__ import annotations

import torch

from tito import tensors
from tito.errors import FailedPrecondition, InvalidArgument, Unavailable
from tito_engine.multimodal.domain import EncoderCacheDescriptor, Placeholder, RawTensor
from tito_engine.multimodal.encoder_cache import CacheEntry, CacheKey, EncoderCache
from tito_engine.multimodal.encoder_store import EntryCorrupt, EntryMissing, SharedEncoderStore
from tito_engine.multimodal.items import (EC_DESCRIPTOR_STALE, EC_ENTRY_CORRUPT, EC_ENTRY_EVICTED, EC_MODEL_MISMATCH,
                                          EC_STORE_UNAVAILABLE, CheckedFeatures, CheckedItem, ValidatedFeatures,
                                          ValidatedItem)
from tito_engine.multimodal.specs import TENSORS_REQUIRED, tensor_path
from tito_engine.multimodal.trust import forged, item_content_id

_NO_SPAN = Placeholder(offset=0, length=0)


def resolve_cached(checked: CheckedFeatures, cache: EncoderCache | None,
                   store: SharedEncoderStore | None = None) -> ValidatedFeatures:
    """Phase 2 (rule 6), where the encoder cache lives (the engine core): cache hits, EC
    descriptors (this engine's own, or the shared `store`'s), MM_TENSORS_REQUIRED; decodes the
    encoder inputs of the items still to encode. An output loaded from `store` goes into `cache`."""
    if store is not None and cache is None:
        raise ValueError("a shared encoder store needs an encoder cache to load into")
    return ValidatedFeatures(tuple(_resolve(c, index, cache, store) for index, c in enumerate(checked.items)),
                             checked.total_bytes)


def check_encoder_cache_enabled(cache: EncoderCache | None) -> EncoderCache:
    if cache is None:
        raise FailedPrecondition("this engine keeps no encoder cache, so Encode has nowhere to store outputs",
                                 reason="ENCODER_CACHE_DISABLED")
    return cache


def _resolve(c: CheckedItem, index: int, cache: EncoderCache | None,
             store: SharedEncoderStore | None = None) -> ValidatedItem:
    item, path = c.item, c.path
    content_id = item_content_id(c)
    key = cache.key_for(content_id) if cache is not None and content_id is not None else None
    entry: CacheEntry | None = None
    from_store = False
    if item.ec_descriptor is not None:
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
        elif item.ec_descriptor is not None:
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
    # Generate's admission requires a placeholder; an Encode item may have none (no token ids to
    # place it in), and then has no span.
    span = item.placeholder or _NO_SPAN
    return ValidatedItem(
        index=index, modality=c.modality, mm_hash=item.mm_hash, offset=span.offset,
        length=span.length, embed_positions=c.embed_positions, num_rows=c.layout.num_rows,
        grid_thw=c.layout.grid_thw, second_per_grid_ts=c.layout.second_per_grid_ts, content_id=content_id,
        cache_key=key, signed=c.signed,
        encoder_inputs=encoder_inputs,
        encoder_rows=entry.rows if entry is not None else None, from_store=from_store)


def _resolve_descriptor(c: CheckedItem, key: CacheKey | None, cache: EncoderCache | None,
                        store: SharedEncoderStore | None = None) -> CacheEntry | None:
    """The cached entry a descriptor names, after checking every claim it makes (never trusting it)."""
    ec, path = c.item.ec_descriptor, c.path
    if cache is None or ec.store_id != cache.store_id:
        ours = repr(cache.store_id) if cache is not None else "none (this engine keeps no encoder cache)"
        shared = (f" or the shared encoder store ({store.store_id!r})" if store is not None else
                  "; a descriptor of a shared store (ecdir-...) needs --encoder-store-dir on the same directory "
                  "as the engine that answered Encode")
        raise forged(path, "store_id", f"store {ec.store_id!r} is not this engine's encoder cache ({ours}){shared}")
    if ec.uri != cache.uri:
        raise forged(path, "uri", f"uri {ec.uri!r} does not match this engine's store ({cache.uri!r})")
    if ec.model_fingerprint != cache.model_fingerprint:
        raise forged(path, "model_fingerprint", f"output of model {ec.model_fingerprint!r} cannot be used by "
                                                 f"model {cache.model_fingerprint!r}")
    if key is None:
        return None  # an untrusted metadata-only item: the caller reports MM_TENSORS_REQUIRED
    if ec.key != key.text:
        raise forged(path, "key", f"key {ec.key!r} is not this item's cache key {key.text!r} (it must name the "
                                   f"item's own content)")
    entry = cache.get(key)
    if entry is None:
        return None  # evicted since: honest, not forged; fall back to the kwargs if any
    if ec.checksum != entry.checksum:
        raise forged(path, "checksum", "checksum does not match the cached entry's")
    if ec.dtype != entry.dtype or tuple(ec.shape) != entry.shape or ec.byte_size != entry.byte_size:
        raise forged(path, "shape", f"dtype/shape/byte_size ({ec.dtype}, "
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
        raise forged(path, "uri", f"uri {ec.uri!r} does not match the shared encoder store's ({store.uri!r})")
    if ec.model_fingerprint != store.model_fingerprint:
        field_path = f"{path}.ec_descriptor.model_fingerprint"
        raise InvalidArgument(f"{field_path}: the descriptor holds the encoder output of model "
                              f"{ec.model_fingerprint!r}, and this engine serves {store.model_fingerprint!r}; call "
                              f"Encode on an engine of this model", reason=EC_MODEL_MISMATCH, field=field_path)
    if key is None:
        return None, False  # an untrusted metadata-only item: the caller reports MM_TENSORS_REQUIRED
    if ec.key != key.text:
        raise forged(path, "key", f"key {ec.key!r} is not this item's cache key {key.text!r} (it must name the "
                                   f"item's own content)")
    entry = cache.get(key)
    if entry is not None and entry.checksum == ec.checksum:
        _check_descriptor_fields(ec, entry, path)
        return entry, False
    entry = _load_from_store(c, key, cache, store, quiet=False, expected=ec)
    return entry, entry is not None


def _check_descriptor_fields(ec: EncoderCacheDescriptor, entry: CacheEntry, path: str) -> None:
    if ec.dtype != entry.dtype or tuple(ec.shape) != entry.shape or ec.byte_size != entry.byte_size:
        raise forged(path, "shape", f"dtype/shape/byte_size ({ec.dtype}, {list(ec.shape)}, {ec.byte_size}) do "
                                     f"not match the stored entry's")


def _load_from_store(c: CheckedItem, key: CacheKey, cache: EncoderCache, store: SharedEncoderStore, *,
                     quiet: bool, expected: EncoderCacheDescriptor | None = None) -> CacheEntry | None:
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
            raise forged(path, "shape", f"dtype/shape/byte_size ({expected.dtype}, {list(expected.shape)}, "
                                         f"{expected.byte_size}) do not match the stored entry's")
    if len(header.shape) != 2 or header.shape[0] != c.layout.num_rows:
        raise InvalidArgument(f"{path}: the stored encoder output for this item has shape {list(header.shape)}, "
                              f"but its metadata says {c.layout.num_rows} rows; the hash and metadata disagree",
                              reason="MM_METADATA_MISMATCH", field=f"{path}.metadata")
    rows = tensors.to_torch(RawTensor(header.dtype, tuple(header.shape), data), field_path).clone()
    return cache.put_verified(key, rows, checksum=header.checksum, dtype=header.dtype, byte_size=header.byte_size)
