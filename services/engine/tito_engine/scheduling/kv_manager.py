"""KV-cache bookkeeping for the scheduler: which blocks each choice holds, what a request needs
before it can run, prefix-cache lookups and registration, forks. Engine thread only.

The scheduler decides *who* runs; this decides *how many blocks* that takes and hands them out.
All block arithmetic lives here, so the policy code reads as policy.
"""

from __future__ import annotations

from tito_engine.kv_events import BlockStored, extra_keys_or_none
from tito_engine.scheduling.blocks import (BlockAllocator, KVBlocks, block_extra_keys, blocks_for_tokens,
                                           prefix_block_hashes)
from tito_engine.scheduling.kv_pins import KvPinTable, Pin
from tito_engine.scheduling.spans import chunk_boundaries_ok
from tito_engine.request import Request, Sequence


class KVCacheManager:
    def __init__(self, cache: KVBlocks, prefix_caching: bool = True):
        self.cache = cache
        self.allocator: BlockAllocator = cache.allocator
        self.block_size = cache.block_size
        self.prefix_caching = prefix_caching
        self.prefix_cache_hit_tokens = 0  # prompt tokens taken from the prefix cache, since start
        self.pins = KvPinTable()  # prefill requests' prompt blocks, waiting to be pulled

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    # ---------------------------------------------------------------- what a step needs

    def growth_need(self, seq: Sequence, end: int) -> int:
        """Blocks `seq` must add so its table covers `end` tokens."""
        held = len(seq.block_table)
        return blocks_for_tokens(end, self.block_size) - held if end > held * self.block_size else 0

    def grow(self, seq: Sequence, count: int) -> None:
        if count > 0:
            seq.block_table.extend(self.allocator.allocate(count))

    def fork_need(self, request: Request) -> int:
        """Blocks the choices waiting to fork need: a copy of the prompt's partial last block each."""
        waiting = sum(1 for seq in request.sequences if seq.awaiting_fork)
        return waiting if len(request.prompt_ids) % self.block_size else 0

    def reserve_fork_blocks(self, request: Request) -> None:
        need = self.fork_need(request)
        if need:
            request.fork_blocks = self.allocator.allocate(need)

    def admission_need(self, request: Request, prefilling: list[Sequence], spare_per_choice: int) -> int:
        """Blocks to admit `request`: every token its prefilling choices (re)compute, less cached
        prefix blocks (though taking an evictable one uses up a free one), the fork copies, and
        `spare_per_choice` for each open choice so it can make progress."""
        hashes = self.prefix_hashes(request)
        need = self.fork_need(request)
        for seq in prefilling:
            total = len(request.prompt_ids) + len(seq.output_ids)
            hits, evictable = self.allocator.peek_prefix(hashes[:self._cacheable_blocks(request, total)])
            need += blocks_for_tokens(total, self.block_size) - hits + evictable
        return need + spare_per_choice * len(request.unfinished())

    # ---------------------------------------------------------------- admission

    def allocate_for_admission(self, request: Request, prefilling: list[Sequence], fresh: bool) -> None:
        """Give each prefilling choice its blocks: the longest cached prefix first (taken before
        allocating, since an allocation may evict cached blocks), then fresh blocks for the rest;
        each choice starts computing after its cached prefix."""
        hashes = self.prefix_hashes(request)
        totals = [len(request.prompt_ids) + len(seq.output_ids) for seq in prefilling]
        cached = [self.allocator.take_prefix(hashes[:self._cacheable_blocks(request, total)]) for total in totals]
        for seq, total, prefix in zip(prefilling, totals, cached):
            seq.block_table = prefix + self.allocator.allocate(blocks_for_tokens(total, self.block_size) - len(prefix))
            seq.num_computed = len(prefix) * self.block_size
            if fresh:
                request.cached_tokens = max(request.cached_tokens, seq.num_computed)
            self.prefix_cache_hit_tokens += seq.num_computed
            if request.imported_kv is not None and seq.index == 0:
                self._import(request, seq, len(prefix))

    def _import(self, request: Request, seq: Sequence, cached: int) -> None:
        """Write the pulled prompt blocks after the `cached` ones the prefix cache gave, so only
        the prompt's last token is computed (it gives the first token's logits). Pulled blocks
        were chosen by an earlier look at the cache: if it lost some since, the gap is
        recomputed instead (the import is dropped, never half used). Used once: after a
        preemption the request recomputes."""
        imported, request.imported_kv = request.imported_kv, None
        block_bytes = getattr(self.cache, "block_bytes", None)
        if imported.first_block > cached or len(seq.output_ids) or any(len(data) != block_bytes
                                                                       for data in imported.blocks):
            return
        for offset, data in enumerate(imported.blocks):
            index = imported.first_block + offset
            if index >= cached:
                self.cache.write_block(seq.block_table[index], data)
        seq.num_computed = len(request.prompt_ids) - 1
        self.register_computed(request, seq, cached * self.block_size)  # pulled blocks serve later prompts too

    def peek_cached_blocks(self, request: Request) -> int:
        """Leading prompt blocks the prefix cache holds now (a decode request pulls the rest)."""
        hashes = self.prefix_hashes(request)
        hits, _ = self.allocator.peek_prefix(hashes[:self._cacheable_blocks(request, len(request.prompt_ids))])
        return hits

    def _cacheable_blocks(self, request: Request, total: int) -> int:
        # At most all but the last token comes from the cache: the last one must run to give logits.
        # And the prefix must not end inside a span the prefill may not split (Gemma3's
        # bidirectional image spans; any run of encoder rows while unresolved): the computing
        # chunk then starts at the span's start, never inside it.
        blocks = (total - 1) // self.block_size
        while blocks and not chunk_boundaries_ok(request.mm, 0, blocks * self.block_size):
            blocks -= 1
        return blocks

    def prefix_hashes(self, request: Request) -> list[bytes]:
        """The prompt's full-block digests (empty when prefix caching is off, or for a media
        request whose items the core gave no prefix keys)."""
        if request.block_hashes is None:
            # The token ids of two different images are equal, so a block covering an image is
            # keyed by the item's trusted content id too (blocks.BlockMedia), never by tokens alone.
            media = request.prefix_media if request.has_media or request.mm is not None else ()
            cacheable = self.prefix_caching and media is not None
            if cacheable:
                request.block_hashes = prefix_block_hashes(request.prompt_ids, self.block_size,
                                                           request.cache_salt, media, request.lora_key)
                request.block_keys = block_extra_keys(len(request.block_hashes), self.block_size,
                                                      request.cache_salt, media)
            else:
                request.block_hashes = []
        return request.block_hashes

    def register_computed(self, request: Request, seq: Sequence, before: int) -> None:
        """Publish the prompt blocks a step completed (computed tokens went from `before` on); the
        blocks the cache gained are reported as BlockStored events, one per run of consecutive
        blocks."""
        hashes = request.block_hashes
        if not hashes or before >= len(hashes) * self.block_size:
            return
        events = self.allocator.events
        run: list[int] = []
        for index in range(before // self.block_size, min(seq.num_computed // self.block_size, len(hashes))):
            if self.allocator.register(seq.block_table[index], hashes[index]) and events is not None:
                if run and run[-1] != index - 1:
                    events.append(self._stored(request, run))
                    run = []
                run.append(index)
        if run:
            events.append(self._stored(request, run))

    def _stored(self, request: Request, indices: list[int]) -> BlockStored:
        size = self.block_size
        first, last = indices[0], indices[-1]
        hashes = request.block_hashes
        return BlockStored(tuple(hashes[first:last + 1]), hashes[first - 1] if first else None,
                           tuple(request.prompt_ids[first * size:(last + 1) * size]), size,
                           extra_keys_or_none(request.block_keys[first:last + 1]), self.allocator.medium,
                           request.lora_name or None)

    def clear_prefix_cache(self) -> None:
        self.allocator.clear_prefix_cache()

    def take_events(self) -> list:
        """The KV events since the last call (recording starts with the first call)."""
        events = self.allocator.events
        self.allocator.events = []
        return events or []

    # ---------------------------------------------------------------- forks and release

    def fork(self, request: Request, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 start from choice 0's prompt KV: full blocks shared, the partial one copied."""
        block_size = self.block_size
        prompt_len = len(request.prompt_ids)
        full = prompt_len // block_size
        shared = parent.block_table[:full]
        children = [seq for seq in request.sequences if seq.awaiting_fork]
        spare = request.fork_blocks
        request.fork_blocks = []
        for child in children:
            child.awaiting_fork = False
            self.allocator.share(shared)
            child.block_table = list(shared)
            if prompt_len % block_size:
                block = spare.pop()
                self.cache.copy_block(parent.block_table[full], block)
                child.block_table.append(block)
            child.num_computed = parent.num_computed
        return children

    def pin(self, request: Request, seq: Sequence, deadline: float) -> Pin:
        """Keep the prompt blocks of a finished prefill choice under its transfer id (the
        reference the choice held moves to the pin; blocks past the prompt are released)."""
        keep = blocks_for_tokens(len(request.prompt_ids), self.block_size)
        blocks, extra = seq.block_table[:keep], seq.block_table[keep:]
        seq.block_table = []
        if extra:
            self.allocator.release(extra)
        pin = Pin(request.kv_pin.transfer_id, tuple(blocks), len(request.prompt_ids), deadline)
        self.pins.add(pin)
        return pin

    def take_pin(self, transfer_id: str, now: float) -> Pin | None:
        """The pin under `transfer_id`, out of the table; the caller reads, then `unpin`s it."""
        return self.pins.take(transfer_id, now)

    def unpin(self, pin: Pin) -> None:
        self.allocator.release(list(pin.blocks))

    def expire_pins(self, now: float) -> int:
        """Free the blocks of every pin past its deadline; how many pins expired."""
        expired = self.pins.expire(now)
        for pin in expired:
            self.unpin(pin)
        return len(expired)

    def release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.release(seq.block_table)
            seq.block_table = []

    def free(self, request: Request) -> None:
        """Every block `request` holds: its choices' tables and unused fork copies."""
        for seq in request.sequences:
            self.release(seq)
        if request.fork_blocks:
            self.allocator.release(request.fork_blocks)
            request.fork_blocks = []
