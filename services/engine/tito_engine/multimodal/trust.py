"""Which media items the engine may trust, and with what (rule 3 of admission, and the
content identity rule 6 keys the encoder cache by).

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

EC descriptors name either this engine's own encoder cache (`engine://<store_id>`) or the shared
encoder store (`ecdir://<store_id>`, `--encoder-store-dir`, encoder_store.py) the engine shares
with others. A descriptor naming another store, another model, a key other than the item's cache
key, or a checksum other than the entry's is rejected without being read (INVALID_ARGUMENT
`EC_DESCRIPTOR_INVALID`; for the shared store: another model is `EC_MODEL_MISMATCH`, other
contents under the right key `EC_DESCRIPTOR_STALE`, a missing entry `EC_ENTRY_EVICTED`, a file
that fails verification `EC_ENTRY_CORRUPT`; an item that still has kwargs is encoded instead).
With signing keys, a descriptor may carry its own tag, made by the engine that answered Encode
(`tito.signing.sign_descriptor`): render signs items before they are encoded, so the item's tag
then covers the item without the descriptor, the descriptor's tag the descriptor (its key names
the signed mm_hash, so it cannot be moved to another item). A bad descriptor tag is refused
(`EC_DESCRIPTOR_INVALID`, field `...ec_descriptor.auth_tag`).
A cache hit pins the entry's rows into the `ValidatedItem`, so a later eviction cannot make an
admitted request fail.
"""

from __future__ import annotations

import hashlib
import struct

from tito import signing
from tito.errors import InvalidArgument
from tito_engine.multimodal.domain import MediaItem
from tito_engine.multimodal.items import EC_DESCRIPTOR_INVALID, SIGNATURE_INVALID, CheckedItem, FeaturePolicy


def check_signature(item: MediaItem, policy: FeaturePolicy, path: str) -> bool:
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
    if item.ec_descriptor is not None and item.ec_descriptor.auth_tag \
            and not signing.verify_descriptor(item.ec_descriptor, policy.signing_keys):
        raise forged(path, "auth_tag", "the descriptor's tag does not verify: it was changed after the encoding "
                                        "engine signed it, or signed with a key this engine does not have")
    return True


def forged(path: str, part: str, message: str) -> InvalidArgument:
    """The refusal of a descriptor whose `part` claims what the engine cannot confirm."""
    field_path = f"{path}.ec_descriptor.{part}"
    return InvalidArgument(f"{field_path}: {message}; the descriptor was not used", reason=EC_DESCRIPTOR_INVALID,
                           field=field_path)


def content_digest(item: MediaItem) -> str:
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


def item_content_id(c: CheckedItem) -> str | None:
    """The identity of the item's content the engine may rely on (see "Trust model")."""
    if c.trusted_hash:
        return c.item.mm_hash
    if c.item.kwargs:
        return content_digest(c.item)
    return None
