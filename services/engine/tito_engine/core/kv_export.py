"""The core's halves of a KV transfer: hand out a pinned prompt's blocks once, then free them;
and whether a pulled prompt can skip the encoder (kv_transfer.py tells the whole story)."""

from __future__ import annotations

import time

from tito_engine.core.messages import ExportKv, KvExport
from tito_engine.kv_transfer import HANDLE_FORGED, KvLayout, KvPinned, unknown_handle
from tito_engine.scheduling.kv_manager import KVCacheManager
from tito_engine.scheduling.blocks import blocks_for_tokens
from tito_engine.scheduling.kv_pins import Pin
from tito.errors import PermissionDenied, InvalidArgument


def export_pinned(kv: KVCacheManager, command: ExportKv, now: float) -> KvExport:
    """The blocks pinned under the command's transfer id from its first block on; the pin is
    gone afterwards whatever happens (single use)."""
    pin = kv.take_pin(command.transfer_id, now)
    if pin is None:
        raise unknown_handle("pulled already, expired, or never pinned here")
    try:
        if (command.block_count, command.num_tokens) != (len(pin.blocks), pin.num_tokens):
            raise PermissionDenied("the KV transfer handle's block_count or num_tokens is not what was pinned",
                                   reason=HANDLE_FORGED, field="handle.block_count")
        if command.first_block > len(pin.blocks):
            raise InvalidArgument(f"first_block {command.first_block} is past the handle's {len(pin.blocks)} blocks",
                                  reason="INVALID_REQUEST", field="first_block")
        sent = pin.blocks[command.first_block:]
        return KvExport(command.first_block, tuple(kv.cache.read_block(block) for block in sent))
    finally:
        kv.unpin(pin)


def pinned_output(pin: Pin, cache) -> KvPinned:
    """What a prefill request's last output says of its pin (the service makes the handle)."""
    layout = cache.layout
    expires_at = time.time() + max(0.0, pin.deadline - time.monotonic())
    return KvPinned(pin.transfer_id, len(pin.blocks), cache.block_size, pin.num_tokens, cache.dtype_name,
                    KvLayout(layout.num_layers, layout.kv_heads, layout.head_dim), expires_at)


def covers_media(request, validated, cache) -> bool:
    """Whether `request`'s pulled blocks hold its whole prompt in this cache's block layout, with
    its last token (the one computed here) outside every media item: then the import cannot be
    dropped (media prompts pull from block 0) and no position needing encoder rows is computed."""
    imported = request.imported_kv
    block_bytes = getattr(cache, "block_bytes", None)
    if imported is None or imported.first_block != 0 or block_bytes is None:
        return False
    whole = len(imported.blocks) == blocks_for_tokens(len(request.prompt_ids), cache.block_size)
    last = len(request.prompt_ids) - 1
    return (whole and all(len(data) == block_bytes for data in imported.blocks)
            and all(not item.offset <= last < item.offset + item.length for item in validated.items))
