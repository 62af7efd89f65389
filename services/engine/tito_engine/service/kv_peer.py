"""The decode engine's client to a prefilling engine: pull a handle's blocks (PullKvBlocks), each
checked by index, size and checksum, within a deadline. gRPC stays in this module; what the
prefilling engine refused comes back as the same TitoError (code and reason), anything else as
UNAVAILABLE KV_TRANSFER_FAILED."""

from __future__ import annotations

import grpc

from tito.errors import FailedPrecondition, PermissionDenied, TitoError, Unavailable
from tito.grpc_errors import error_details
from tito.security import ClientSecurity
from tito.v1 import engine_pb2, engine_pb2_grpc

from tito_engine.kv_transfer import HANDLE_FORGED, HANDLE_UNKNOWN, TRANSFER_FAILED, KvHandle, block_checksum
from tito_engine.service.convert import handle_to_proto

#: Most seconds one pull may take (a prompt's KV between two engines of one cluster: far less).
PULL_DEADLINE_S = 30.0
_MAX_MESSAGE_BYTES = 256 << 20


class KvPeers:
    """One channel per prefilling engine's address, reused across pulls, with `security`'s TLS and
    bearer token."""

    def __init__(self, security: ClientSecurity = ClientSecurity(), deadline_s: float = PULL_DEADLINE_S):
        self.deadline_s = deadline_s
        self._security = security
        self._metadata = security.call_metadata()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def pull(self, address: str, handle: KvHandle, first_block: int) -> list[bytes]:
        """Blocks first_block..block_count-1 of `handle`, in prompt order."""
        stub = engine_pb2_grpc.EngineServiceStub(self._channel(address))
        request = engine_pb2.PullKvBlocksRequest(handle=handle_to_proto(handle), first_block=first_block)
        blocks: list[bytes] = []
        try:
            async for message in stub.PullKvBlocks(request, timeout=self.deadline_s, metadata=self._metadata):
                _check_block(message, first_block + len(blocks))
                blocks.append(message.data)
        except grpc.aio.AioRpcError as exc:
            raise _refusal(exc, address) from None
        if len(blocks) != handle.block_count - first_block:
            raise _failed(f"{address} sent {len(blocks)} of {handle.block_count - first_block} KV blocks")
        return blocks

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]
            channel = self._channels[address] = self._security.aio_channel(address, options=options)
        return channel


def _check_block(message: engine_pb2.PullKvBlocksResponse, expected_index: int) -> None:
    data = message.data
    if message.block_index != expected_index or message.byte_size != len(data) \
            or message.checksum != block_checksum(data):
        raise _failed(f"KV block {message.block_index} arrived damaged (index, size or checksum does not match)")


def _refusal(exc: grpc.aio.AioRpcError, address: str) -> TitoError:
    details = error_details(exc)
    reason = details["reason"]
    if reason == HANDLE_UNKNOWN:
        return FailedPrecondition(details["message"], reason=HANDLE_UNKNOWN, field="kv_transfer.decode.handle")
    if reason == HANDLE_FORGED:
        return PermissionDenied(details["message"], reason=HANDLE_FORGED, field="kv_transfer.decode.handle")
    return _failed(f"pulling KV blocks from {address} failed: {exc.code().name} {details['message']}")


def _failed(message: str) -> Unavailable:
    return Unavailable(f"{message}; prefill again, or decode without a handle", reason=TRANSFER_FAILED)
