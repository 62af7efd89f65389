"""Block arithmetic of the paged KV cache, torch-free: the pool of block ids with reference counts
and the prefix cache (`BlockAllocator`), chained prefix-block digests, and what the scheduler needs
of the storage (`KVBlocks`; the torch storage is `tito_engine.model.kv_cache.PagedKVCache`).

Sequences own lists of block ids (their block tables); a block shared by the choices of one
request (the prompt's full blocks after a fork) carries a reference count and returns to the pool
when the last owner lets go.

The prefix cache reports what it stores, evicts and clears as KV events (`tito_engine.kv_events`,
vLLM's shapes) into `BlockAllocator.events` when that is a list: evictions and clears here, stores
in `KVCacheManager.register_computed`, which knows the blocks' tokens and keys.
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tito_engine.kv_events import AllBlocksCleared, BlockKeys, BlockRemoved, KvEvent, MediaKey


class KVBlocks(Protocol):
    """The KV storage as the scheduler sees it: its block pool and one copy operation."""

    num_blocks: int
    block_size: int
    allocator: "BlockAllocator"

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a partial block at fork)."""

    def write_block(self, block: int, data: bytes) -> None:
        """Fill one block's K/V from another engine's bytes (prefill/decode transfer)."""

    def read_block(self, block: int) -> bytes:
        """One block's K/V as bytes, for another engine (prefill/decode transfer)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


class BlockAllocator:
    """A pool of block ids with reference counts and a prefix cache. Engine thread only (no locks).

    Prefix cache: a full block of prompt tokens can be registered under a hash of everything
    before and in it (`prefix_block_hashes`). When its last owner releases it, the block keeps its
    K/V and its hash and waits in an LRU of evictable blocks; a later request whose prompt starts
    the same takes it back instead of recomputing. Evictable blocks count as free: `allocate`
    evicts the least recently used when the plain free list is empty.
    """

    def __init__(self, num_blocks: int, medium: str | None = None):
        self.num_blocks = num_blocks
        self.medium = medium  # where the blocks live, as KV events name it ("CPU", "GPU")
        # KV events since the owner last took them (None: not recorded).
        self.events: list[KvEvent] | None = None
        # Pop from the end: recently freed blocks are reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} KV blocks, {self.num_free} free")  # callers check first
        blocks = []
        evicted = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                digest = self._hash_of.pop(block)
                del self._by_hash[digest]
                evicted.append(digest)
            self._refs[block] = 1
            blocks.append(block)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(tuple(evicted), self.medium))
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
            elif self._refs[block] < 0:  # a double free would hand one block to two sequences
                raise AssertionError(f"KV block {block} released more often than taken")

    # ---------------------------------------------------------------- prefix cache

    def peek_prefix(self, hashes: list[bytes]) -> tuple[int, int]:
        """(blocks of the longest cached prefix of `hashes`, how many of them are evictable now)."""
        hits = evictable = 0
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            hits += 1
            evictable += self._refs[block] == 0
        return hits, evictable

    def take_prefix(self, hashes: list[bytes]) -> list[int]:
        """Take a reference on each block of the longest cached prefix of `hashes`."""
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def register(self, block: int, digest: bytes) -> bool:
        """Record that `block` holds the full prefix block `digest` (first writer wins); whether
        the cache gained it."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest
            return True
        return False

    def clear_prefix_cache(self) -> None:
        """Forget every cached block: unreferenced ones return to the free list, blocks in use keep
        their K/V for their owners but can no longer be shared."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())


@dataclass(frozen=True, slots=True)
class BlockMedia:
    """A media item of a prompt as the prefix cache keys it: its placeholder range, the content id
    the engine trusts (features.ValidatedItem.content_id: what the block digests cover) and the
    mm_hash render gave (what KV events publish, the key a router knows)."""

    offset: int
    length: int
    content_id: str
    mm_hash: str


def prefix_block_hashes(token_ids: list[int], block_size: int, salt: str = "",
                        media: Sequence[BlockMedia] = (), lora: str = "") -> list[bytes]:
    """Chained digests of the full blocks of `token_ids`: each covers the salt, the LoRA adapter
    (`lora`, its key; empty for the base model), every token up to the end of its block and every
    media item overlapping a block up to there (its content id and its offset in the block), so
    equal digests mean equal K/V (same weights, tokens and media at the same positions). sha256,
    not Python's hash: a crafted collision must not let one tenant read another's K/V."""
    digests = []
    previous = hashlib.sha256(b"tito-prefix\0" + salt.encode()).digest()
    if lora:  # a digest of its own over the salt's: no salt can spell an adapter; the base chain is unchanged
        previous = hashlib.sha256(b"tito-lora\0" + previous + lora.encode()).digest()
    for end in range(block_size, len(token_ids) + 1, block_size):
        start = end - block_size
        chunk = array("I", token_ids[start:end]).tobytes()
        for item in _overlapping(media, start, end):
            content = item.content_id.encode()
            chunk += b"\0mm" + struct.pack("<qQ", item.offset - start, len(content)) + content
        previous = hashlib.sha256(previous + chunk).digest()
        digests.append(previous)
    return digests


def block_extra_keys(num_blocks: int, block_size: int, salt: str = "",
                     media: Sequence[BlockMedia] = ()) -> list[BlockKeys]:
    """What KV events publish per block besides its tokens, in vLLM's form: the (mm_hash, offset
    in the block) of every media item overlapping it, and the cache_salt on the first block."""
    keys = []
    for index in range(num_blocks):
        start = index * block_size
        items = tuple(MediaKey(item.mm_hash, item.offset - start)
                      for item in _overlapping(media, start, start + block_size))
        keys.append(BlockKeys(items, salt if index == 0 else ""))
    return keys


def _overlapping(media: Sequence[BlockMedia], start: int, end: int) -> list[BlockMedia]:
    return [item for item in media if item.offset < end and item.offset + item.length > start]
