"""KV-cache bookkeeping for the scheduler: which blocks each choice holds, what a request needs
before it can run, prefix-cache lookups and registration, forks. Engine thread only.

The scheduler decides *who* runs; this decides *how many blocks* that takes and hands them out.
All block arithmetic lives here, so the policy code reads as policy.
"""

from __future__ import annotations

from tito_engine.scheduling.blocks import BlockAllocator, KVBlocks, blocks_for_tokens, prefix_block_hashes
from tito_engine.request import Request, Sequence


class KVCacheManager:
    def __init__(self, cache: KVBlocks, prefix_caching: bool = True):
        self.cache = cache
        self.allocator: BlockAllocator = cache.allocator
        self.block_size = cache.block_size
        self.prefix_caching = prefix_caching
        self.prefix_cache_hit_tokens = 0  # prompt tokens taken from the prefix cache, since start

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
            hits, evictable = self.allocator.peek_prefix(hashes[:self._cacheable_blocks(total)])
            need += blocks_for_tokens(total, self.block_size) - hits + evictable
        return need + spare_per_choice * len(request.unfinished())

    # ---------------------------------------------------------------- admission

    def allocate_for_admission(self, request: Request, prefilling: list[Sequence], fresh: bool) -> None:
        """Give each prefilling choice its blocks: the longest cached prefix first (taken before
        allocating, since an allocation may evict cached blocks), then fresh blocks for the rest;
        each choice starts computing after its cached prefix."""
        hashes = self.prefix_hashes(request)
        totals = [len(request.prompt_ids) + len(seq.output_ids) for seq in prefilling]
        cached = [self.allocator.take_prefix(hashes[:self._cacheable_blocks(total)]) for total in totals]
        for seq, total, prefix in zip(prefilling, totals, cached):
            seq.block_table = prefix + self.allocator.allocate(blocks_for_tokens(total, self.block_size) - len(prefix))
            seq.num_computed = len(prefix) * self.block_size
            if fresh:
                request.cached_tokens = max(request.cached_tokens, seq.num_computed)
            self.prefix_cache_hit_tokens += seq.num_computed

    def _cacheable_blocks(self, total: int) -> int:
        # At most all but the last token comes from the cache: the last one must run to give logits.
        return (total - 1) // self.block_size

    def prefix_hashes(self, request: Request) -> list[bytes]:
        """The prompt's full-block digests (empty when prefix caching is off or media are involved)."""
        if request.block_hashes is None:
            # Media requests stay out of the prefix cache: the token ids of two different images
            # are equal, so a block covering an image must not be keyed by tokens alone.
            cacheable = self.prefix_caching and not request.has_media and request.mm is None
            request.block_hashes = prefix_block_hashes(request.prompt_ids, self.block_size,
                                                       request.cache_salt) if cacheable else []
        return request.block_hashes

    def register_computed(self, request: Request, seq: Sequence, before: int) -> None:
        """Publish the prompt blocks a step completed (computed tokens went from `before` on)."""
        hashes = request.block_hashes
        if not hashes or before >= len(hashes) * self.block_size:
            return
        for index in range(before // self.block_size, min(seq.num_computed // self.block_size, len(hashes))):
            self.allocator.register(seq.block_table[index], hashes[index])

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
