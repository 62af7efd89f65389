"""An engine's LoRA adapters, as an operator or a router manages them (EngineService's
LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters).

    adapters = LoraAdapters(grpc.insecure_channel("127.0.0.1:50052"))
    adapters.load("sql", "sql-r16")           # a directory under the engine's --lora-dir
    [a.name for a in adapters.list()]          # ['sql']
    adapters.unload("sql")                     # requests still using it (they finish with it)

Refusals arrive as grpc.RpcError with the engine's reason (tito.grpc_errors.error_details):
LORA_PATH_NOT_ALLOWED, LORA_ADAPTER_INVALID, LORA_BASE_MISMATCH, LORA_RANK_TOO_LARGE,
LORA_ADAPTER_EXISTS, LORA_SLOTS_BUSY, LORA_ADAPTER_NOT_FOUND, LORA_DISABLED.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tito.v1 import engine_pb2, engine_pb2_grpc


class LoraAdapters:
    """The adapter calls of one engine over `channel` (`metadata`: e.g. the bearer token)."""

    def __init__(self, channel: grpc.Channel, timeout: float = 60.0,
                 metadata: Sequence[tuple[str, str]] | None = None):
        self._stub = engine_pb2_grpc.EngineServiceStub(channel)
        self._timeout = timeout
        self._metadata = tuple(metadata or ())

    def load(self, name: str, path: str) -> engine_pb2.LoraAdapterInfo:
        """Load the adapter in `path` (under the engine's --lora-dir) as `name`."""
        response = self._stub.LoadLoraAdapter(engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path),
                                              timeout=self._timeout, metadata=self._metadata)
        return response.adapter

    def unload(self, name: str) -> int:
        """Forget `name`; the requests still using it (they finish with it)."""
        response = self._stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name=name),
                                                timeout=self._timeout, metadata=self._metadata)
        return response.active_requests

    def list(self) -> list[engine_pb2.LoraAdapterInfo]:
        """The adapters the engine holds, by name."""
        response = self._stub.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=self._timeout,
                                               metadata=self._metadata)
        return list(response.adapters)
