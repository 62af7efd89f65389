"""The engine core's LoRA adapters: which it holds, which sit in the model's slots, who uses them.

An adapter is *held* from LoadLoraAdapter (or `--lora-modules` at start) until UnloadLoraAdapter;
its checked weights stay in host memory. At most `max_loras` held adapters are *resident* (in a
slot of model/lora.py's stacks) at once. A request takes its adapter at AddRequest (`acquire`:
made resident first when it is not, in a free slot or in the least recently used idle adapter's)
and lets go when it ends (`release`), so a slot never changes under a running or waiting request;
when every slot's adapter is in use, the request is refused (RESOURCE_EXHAUSTED LORA_SLOTS_BUSY)
rather than queued behind requests that may run for minutes.

Unloading an adapter that requests use marks it *unloading*: they finish with it, new requests
naming it are refused (NOT_FOUND), and its slot is freed when the last one ends. The core runs
commands one at a time, so two loads of one name are never interleaved: the second is refused
(ALREADY_EXISTS).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tito.errors import AlreadyExists, NotFound, ResourceExhausted

from tito_engine.lora_types import LoraAdapterInfo, check_lora_name
from tito_engine.model.lora_files import resolve_adapter_dir

log = logging.getLogger(__name__)

NOT_FOUND = "LORA_ADAPTER_NOT_FOUND"


class AdapterSlots(Protocol):
    """The model side (model/lora.LoraSlots): reads adapters for this model, fills and empties slots."""

    max_loras: int

    def read(self, directory: Path) -> Any: ...

    def write(self, slot: int, adapter: Any) -> None: ...

    def clear(self, slot: int) -> None: ...


@dataclass(eq=False)
class _Held:
    name: str
    path: str  # relative to the root
    adapter: Any  # lora_files.LoraAdapter
    key: str  # what its prefix-cache blocks are chained under
    slot: int = 0  # 0: not resident
    active: int = 0
    unloading: bool = False
    last_used: int = 0

    def info(self) -> LoraAdapterInfo:
        return LoraAdapterInfo(self.name, self.path, self.adapter.rank, self.adapter.targets, self.active,
                               self.slot > 0)


class LoraRegistry:
    """The adapters of one engine core (engine thread only)."""

    def __init__(self, slots: AdapterSlots, root: Path):
        self._slots = slots
        self._root = root
        self._held: dict[str, _Held] = {}
        self._clock = itertools.count(1)
        self.infos: tuple[LoraAdapterInfo, ...] = ()  # refreshed on every change (CoreLoad reads it each step)

    def load(self, name: str, path: str) -> LoraAdapterInfo:
        """Hold the adapter in `path` (under the root) as `name`, resident at once."""
        check_lora_name(name)
        held = self._held.get(name)
        if held is not None:
            why = f"is being unloaded ({held.active} requests still use it)" if held.unloading else "is already loaded"
            raise AlreadyExists(f"LoRA adapter {name!r} {why}; unload it first to load it again",
                                reason="LORA_ADAPTER_EXISTS", field="lora_name")
        directory = resolve_adapter_dir(self._root, path)
        adapter = self._slots.read(directory)
        entry = _Held(name, str(directory.relative_to(self._root.resolve())), adapter, f"{name}\0{adapter.fingerprint}")
        self._make_resident(entry)
        self._held[name] = entry
        self._changed()
        log.info("loaded LoRA adapter %s from %s (rank %d, %s) into slot %d", name, entry.path, adapter.rank,
                 ",".join(adapter.targets), entry.slot)
        return entry.info()

    def unload(self, name: str) -> int:
        """Forget `name`: now when no request uses it, else after the last one; the requests still
        using it."""
        entry = self._find(name)
        entry.unloading = True
        if entry.active == 0:
            self._drop(entry)
        self._changed()
        return entry.active

    def acquire(self, name: str) -> tuple[int, str]:
        """A new request's hold on `name`: (its slot, its prefix-cache key)."""
        entry = self._find(name)
        self._make_resident(entry)
        entry.active += 1
        self._changed()
        return entry.slot, entry.key

    def prefix_key(self, name: str) -> str | None:
        """The key `name`'s prefix-cache blocks are chained under; None when it is not held."""
        entry = self._held.get(name)
        return None if entry is None or entry.unloading else entry.key

    def release(self, name: str) -> None:
        """A request that held `name` ended."""
        entry = self._held.get(name)
        if entry is None:
            return
        entry.active -= 1
        if entry.unloading and entry.active == 0:
            self._drop(entry)
        self._changed()

    def _find(self, name: str) -> _Held:
        entry = self._held.get(name)
        if entry is None or entry.unloading:
            held = ", ".join(sorted(n for n, e in self._held.items() if not e.unloading)) or "none"
            raise NotFound(f"LoRA adapter {name[:140]!r} is not loaded on this engine (loaded: {held}); load it with "
                           f"LoadLoraAdapter or send the request where it is", reason=NOT_FOUND, field="lora_name")
        return entry

    def _make_resident(self, entry: _Held) -> None:
        entry.last_used = next(self._clock)
        if entry.slot:
            return
        taken = {held.slot for held in self._held.values() if held.slot}
        free = [slot for slot in range(1, self._slots.max_loras + 1) if slot not in taken]
        if free:
            slot = free[0]
        else:
            idle = [held for held in self._held.values() if held.slot and held.active == 0]
            if not idle:
                raise ResourceExhausted(
                    f"all {self._slots.max_loras} LoRA adapter slots hold adapters in use; retry when requests "
                    f"finish, or on another engine (--max-loras sets the slots)", reason="LORA_SLOTS_BUSY",
                    field="lora_name")
            victim = min(idle, key=lambda held: held.last_used)
            slot, victim.slot = victim.slot, 0
            log.info("LoRA adapter %s leaves slot %d for %s (least recently used)", victim.name, slot, entry.name)
        self._slots.write(slot, entry.adapter)
        entry.slot = slot

    def _drop(self, entry: _Held) -> None:
        if entry.slot:
            self._slots.clear(entry.slot)
        del self._held[entry.name]
        log.info("unloaded LoRA adapter %s", entry.name)

    def _changed(self) -> None:
        self.infos = tuple(entry.info() for entry in sorted(self._held.values(), key=lambda e: e.name)
                           if not entry.unloading)
