"""LoRA adapters on the vllm backend: tito's RPCs and `lora_name` mapped to vLLM's own LoRA support
(`enable_lora`, `LoRARequest`, `AsyncLLM.add_lora` / `remove_lora`).

The same rules as the native engine (core/lora_registry.py), so both refuse alike: names by
tito.lora_names, paths only under `--lora-dir` (model/lora_files.resolve_adapter_dir), the
adapter's config checked here (LoRA, rank within `--max-lora-rank`, weights file present) and its
weights by vLLM itself (what vLLM refuses is LORA_ADAPTER_INVALID with vLLM's reason), a name
held or being loaded refused (ALREADY_EXISTS), an unknown one NOT_FOUND. vLLM keeps `max_loras`
adapters on the device and swaps them itself, least recently used first, so residency is its
business. Unloading an adapter in use marks it: its requests finish with it, new ones are
refused, and vLLM's `remove_lora` runs after the last one.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito.errors import AlreadyExists, InvalidArgument, NotFound

from tito_engine.lora_types import LoraAdapterInfo, check_lora_name
from tito_engine.model.lora_files import PATH_FIELD, read_adapter_config, resolve_adapter_dir

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    name: str
    path: str  # relative to the root
    request: Any  # vllm.lora.request.LoRARequest
    rank: int
    targets: tuple[str, ...]
    active: int = 0
    unloading: bool = False

    def info(self) -> LoraAdapterInfo:
        return LoraAdapterInfo(self.name, self.path, self.rank, self.targets, self.active, True)


class VllmLoraAdapters:
    """The adapters of one VllmEngine (its event loop only)."""

    def __init__(self, llm: Any, root: Path, max_rank: int):
        self._llm, self._root, self._max_rank = llm, root, max_rank
        self._held: dict[str, _Held] = {}
        self._loading: set[str] = set()
        self._ids = itertools.count(1)

    def register(self, name: str, path: str) -> _Held:
        """Check and hold an adapter (vLLM reads its weights when first asked to)."""
        from vllm.lora.request import LoRARequest

        check_lora_name(name)
        if name in self._held or name in self._loading:
            held = self._held.get(name)
            why = "is being unloaded" if held is not None and held.unloading else "is already loaded"
            raise AlreadyExists(f"LoRA adapter {name!r} {why}; unload it first to load it again",
                                reason="LORA_ADAPTER_EXISTS", field="lora_name")
        directory = resolve_adapter_dir(self._root, path)
        config = read_adapter_config(directory, self._max_rank)
        targets = config.get("target_modules") or ()
        targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
        entry = _Held(name, str(directory.relative_to(self._root.resolve())),
                      LoRARequest(name, next(self._ids), str(directory)), config["r"], targets)
        self._held[name] = entry
        return entry

    async def load(self, name: str, path: str) -> LoraAdapterInfo:
        """LoadLoraAdapter: checked here, then loaded by vLLM (its refusal: LORA_ADAPTER_INVALID)."""
        entry = self.register(name, path)
        self._loading.add(name)
        try:
            await self._llm.add_lora(entry.request)
        except Exception as exc:  # noqa: BLE001 - vLLM refuses an adapter in many ways
            del self._held[name]
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidArgument(f"vLLM cannot load the adapter: {reason[:300]}", reason="LORA_ADAPTER_INVALID",
                                  field=PATH_FIELD) from None
        finally:
            self._loading.discard(name)
        log.info("loaded LoRA adapter %s from %s into vLLM (rank %d)", name, entry.path, entry.rank)
        return entry.info()

    async def preload(self, name: str) -> None:
        """Have vLLM read a registered adapter now rather than at its first request (best effort)."""
        entry = self._held.get(name)
        if entry is None:
            return
        try:
            await self._llm.add_lora(entry.request)
        except Exception:  # noqa: BLE001 - its first request reports it with the status
            log.exception("vLLM could not preload LoRA adapter %s", name)

    async def unload(self, name: str) -> int:
        """UnloadLoraAdapter: the requests still using it."""
        entry = self._find(name)
        entry.unloading = True
        if entry.active == 0:
            await self._drop(entry)
        return entry.active

    def acquire(self, name: str) -> Any:
        """A request's hold on `name`: the LoRARequest vLLM generates with."""
        entry = self._find(name)
        entry.active += 1
        return entry.request

    async def release(self, name: str) -> None:
        entry = self._held.get(name)
        if entry is None:
            return
        entry.active -= 1
        if entry.unloading and entry.active == 0:
            await self._drop(entry)

    def infos(self) -> tuple[LoraAdapterInfo, ...]:
        return tuple(entry.info() for name, entry in sorted(self._held.items())
                     if not entry.unloading and name not in self._loading)

    def _find(self, name: str) -> _Held:
        entry = self._held.get(name)
        if entry is None or entry.unloading or name in self._loading:
            raise NotFound(f"LoRA adapter {name[:140]!r} is not loaded on this engine (loaded: "
                           f"{', '.join(info.name for info in self.infos()) or 'none'}); load it with "
                           f"LoadLoraAdapter or send the request where it is", reason="LORA_ADAPTER_NOT_FOUND",
                           field="lora_name")
        return entry

    async def _drop(self, entry: _Held) -> None:
        del self._held[entry.name]
        try:
            await self._llm.remove_lora(entry.request.lora_int_id)
        except Exception:  # noqa: BLE001 - forgotten here either way; vLLM evicts it in time
            log.exception("vLLM could not remove LoRA adapter %s", entry.name)
        log.info("unloaded LoRA adapter %s", entry.name)
