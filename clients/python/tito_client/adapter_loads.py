"""A router's LoRA adapter loads: the router picked an engine for an adapter it does not hold, and
loads it there (EngineService.LoadLoraAdapter) before the request goes.

One `AdapterLoad` per (engine, adapter) while it runs: every request that picks that engine for
that adapter meanwhile waits on the same load, so concurrent first requests for an adapter make
one LoadLoraAdapter call, not one each. The call runs on its own daemon thread (the router's
`pick` is a short call under a lock and never waits on the network); callers wait with `wait()`
(threads) or `await wait_async()` (asyncio; a thread waits for them).
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from tito.grpc_errors import error_details

#: The engine's reason when it holds the name already: another router (or the operator) loaded it.
ADAPTER_EXISTS = "LORA_ADAPTER_EXISTS"


class AdapterLoad:
    """One LoadLoraAdapter call in flight; `wait` returns once the adapter is on the engine, or
    raises the engine's refusal (a grpc.RpcError: path outside --lora-dir, a corrupt file, ...)."""

    def __init__(self, address: str, name: str, path: str):
        self.address, self.name, self.path = address, name, path
        self._done = threading.Event()
        self._error: grpc.RpcError | None = None

    def finish(self, error: grpc.RpcError | None) -> None:
        """The call ended: loaded (None), or refused with `error`."""
        self._error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"loading LoRA adapter {self.name!r} on {self.address} took over {timeout} s")
        if self._error is not None:
            raise self._error

    async def wait_async(self, timeout: float | None = None) -> None:
        if not self.done:
            await asyncio.to_thread(self._done.wait, timeout)
        self.wait(0)


def loaded(error: grpc.RpcError | None) -> bool:
    """Whether a LoadLoraAdapter call that ended with `error` left the adapter on the engine (it
    already held the name: a load by someone else won the race)."""
    return error is None or (error.code() == grpc.StatusCode.ALREADY_EXISTS
                             and error_details(error)["reason"] == ADAPTER_EXISTS)
