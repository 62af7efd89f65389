"""The paged KV cache: fixed-size blocks of K/V storage, a free pool and reference counts.

Storage per layer is `[num_blocks, block_size, kv_heads, head_dim]`. A token's slot in the flat
view `[num_blocks * block_size, kv_heads, head_dim]` is `block_id * block_size + offset`, so a
step's writes are one `index_copy_` per layer, and its reads gather whole blocks (one
`index_select` of block ids per layer: 16x fewer, 16x larger copies than per token). Sequences own
lists of block ids (their block tables); a block shared by
the choices of one request (the prompt's full blocks after a fork) carries a reference count and
returns to the pool when the last owner lets go (the pool and its prefix cache:
`tito_engine.scheduling.blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tito_engine.kv_events import MEDIUM_CPU, MEDIUM_GPU
from tito_engine.scheduling.blocks import BlockAllocator


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's K/V in one layer and how many layers there are."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize  # K and V

    def blocks_for_bytes(self, budget_bytes: int, block_size: int) -> int:
        return budget_bytes // (self.bytes_per_token * block_size)


class PagedKVCache:
    """K and V storage for every layer plus the block pool that hands it out."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, layout.kv_heads, layout.head_dim)
        # Zeros, not empty: attention reads padded slots under a mask, and 0 * NaN garbage is NaN.
        self.keys = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.values = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        # KV events name where the blocks live the way vLLM does: "GPU" for an accelerator, else "CPU".
        medium = MEDIUM_CPU if torch.device(device).type == "cpu" else MEDIUM_GPU
        self.allocator = BlockAllocator(num_blocks, medium=medium)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a partial block at fork)."""
        for keys, values in zip(self.keys, self.values):
            keys[target] = keys[source]
            values[target] = values[source]

    @property
    def dtype_name(self) -> str:
        return str(self.layout.dtype).removeprefix("torch.")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V in every layer (what `read_block` returns)."""
        return self.layout.bytes_per_token * self.block_size

    def read_block(self, block: int) -> bytes:
        """One block's K then V, each [num_layers, block_size, kv_heads, head_dim], as raw
        little-endian bytes of the cache's dtype (prefill/decode transfer: kv_transfer.py)."""
        stacked = torch.stack([keys[block] for keys in self.keys] + [values[block] for values in self.values])
        return stacked.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def write_block(self, block: int, data: bytes) -> None:
        """Fill one block from `read_block`'s bytes (of an engine with the same layout)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"a KV block holds {self.block_bytes} bytes, got {len(data)}")
        layers = self.layout.num_layers
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.layout.dtype)
        stacked = raw.view(2 * layers, self.block_size, self.layout.kv_heads, self.layout.head_dim).to(self.device)
        for layer in range(layers):
            self.keys[layer][block] = stacked[layer]
            self.values[layer][block] = stacked[layers + layer]
