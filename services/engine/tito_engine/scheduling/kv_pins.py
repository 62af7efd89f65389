"""The pin table: prompt blocks a prefill request left for a decode engine to pull.

A pin holds a reference on its blocks until it is taken (PullKvBlocks, once) or its deadline
passes; either way the blocks go back through the allocator, so pinned KV never leaks. Pure
bookkeeping (time is passed in): the engine core expires pins between steps and wakes for the
next deadline while idle. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """One prefill request's prompt blocks, in prompt order."""

    transfer_id: str
    blocks: tuple[int, ...]
    num_tokens: int
    deadline: float  # time.monotonic() seconds


class KvPinTable:
    def __init__(self):
        self._pins: dict[str, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def pinned_blocks(self) -> int:
        return sum(len(pin.blocks) for pin in self._pins.values())

    def add(self, pin: Pin) -> None:
        if pin.transfer_id in self._pins:  # ids are 128 random bits: a repeat is a bug
            raise AssertionError(f"transfer id {pin.transfer_id} pinned twice")
        self._pins[pin.transfer_id] = pin

    def take(self, transfer_id: str, now: float) -> Pin | None:
        """The pin under `transfer_id`, removed (single use); None when unknown or expired (an
        expired one is left for `expire`, which frees its blocks)."""
        pin = self._pins.get(transfer_id)
        if pin is None or pin.deadline < now:
            return None
        return self._pins.pop(transfer_id)

    def expire(self, now: float) -> list[Pin]:
        """Remove and return every pin whose deadline has passed (the caller frees their blocks)."""
        expired = [pin for pin in self._pins.values() if pin.deadline < now]
        for pin in expired:
            del self._pins[pin.transfer_id]
        return expired

    def next_deadline(self) -> float | None:
        return min((pin.deadline for pin in self._pins.values()), default=None)
