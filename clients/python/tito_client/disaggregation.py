"""Prefill/decode disaggregation from the router's side: a long prompt is prefilled on a prefill
engine (GenerateRequest.kv_transfer.prefill: it computes the prompt's KV and first token and
answers with a KV transfer handle), then decoded on a decode engine that pulls the KV from it
(kv_transfer.decode). The decode engine streams every token, the first included, so the caller
sees one ordinary Generate stream. A prompt the router does not disaggregate (routing.py:
shorter than its threshold, or no prefill engines) goes to one engine unchanged, and so does one
whose prefill engine went away (the decode engine then prefills it itself)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from tito.v1 import engine_pb2

from tito_client.migration import engine_gone
from tito_client.routing import EngineRouter

log = logging.getLogger(__name__)

#: Runs the prefill call on the engine at an address: (address, request) -> the handle.
Prefill = Callable[[str, engine_pb2.GenerateRequest], Awaitable[engine_pb2.KvTransferHandle]]
BlockingPrefill = Callable[[str, engine_pb2.GenerateRequest], engine_pb2.KvTransferHandle]


def prefill_request(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    """The prefill engine's part of `request`."""
    prefill = engine_pb2.GenerateRequest()
    prefill.CopyFrom(request)
    if prefill.request_id:
        prefill.request_id = f"{request.request_id}~prefill"
    prefill.kv_transfer.prefill.SetInParent()
    return prefill


def decode_request(request: engine_pb2.GenerateRequest, handle: engine_pb2.KvTransferHandle,
                   source_address: str) -> engine_pb2.GenerateRequest:
    """The decode engine's part of `request`: the same prompt with the handle of its KV."""
    decode = engine_pb2.GenerateRequest()
    decode.CopyFrom(request)
    decode.kv_transfer.decode.handle.CopyFrom(handle)
    decode.kv_transfer.decode.source_address = source_address
    return decode


def handle_of(responses: list[engine_pb2.GenerateResponse]) -> engine_pb2.KvTransferHandle:
    for response in responses:
        if response.HasField("kv_transfer_handle"):
            return response.kv_transfer_handle
    raise RuntimeError("the prefill engine answered without a KV transfer handle (is it a tito native engine?)")


def _plan(router: EngineRouter, request: engine_pb2.GenerateRequest) -> tuple[str, str | None]:
    """(the decode engine, the prefill engine or None when `request` is not split there)."""
    decode = router.pick(request)
    if not router.disaggregates(request, decode):
        return decode.address, None
    return decode.address, router.pick(request, role="prefill").address


def _fell_back(error: grpc.RpcError, source: str) -> None:
    """A prefill that failed: the decode engine prefills itself when the prefill engine is gone;
    any other refusal is the caller's."""
    if not engine_gone(error):
        raise error
    log.warning("prefill engine %s failed (%s); the decode engine prefills instead", source, error.code().name)


async def place(router: EngineRouter, request: engine_pb2.GenerateRequest, prefill: Prefill
                ) -> tuple[str, engine_pb2.GenerateRequest]:
    """Where `request` is decoded and what is sent there: after its prefill on a prefill engine
    when the router disaggregates it, else as it is. Both engines are picked by the router's
    policy among their role (cache-aware: where the prompt's prefix is); the decode engine first,
    so a prompt it mostly holds is not prefilled elsewhere, and its cached blocks are not pulled."""
    if request.HasField("kv_transfer"):  # the caller split it already: a part goes where its role is served
        return _part_engine(router, request), request
    decode, source = _plan(router, request)
    if source is None:
        return decode, request
    try:
        with router.track(source):
            handle = await prefill(source, prefill_request(request))
    except grpc.RpcError as error:
        _fell_back(error, source)
        return decode, request
    return decode, decode_request(request, handle, source)


def place_blocking(router: EngineRouter, request: engine_pb2.GenerateRequest, prefill: BlockingPrefill
                   ) -> tuple[str, engine_pb2.GenerateRequest]:
    """`place` for synchronous callers (ChatPipeline)."""
    if request.HasField("kv_transfer"):
        return _part_engine(router, request), request
    decode, source = _plan(router, request)
    if source is None:
        return decode, request
    try:
        with router.track(source):
            handle = prefill(source, prefill_request(request))
    except grpc.RpcError as error:
        _fell_back(error, source)
        return decode, request
    return decode, decode_request(request, handle, source)


def _part_engine(router: EngineRouter, request: engine_pb2.GenerateRequest) -> str:
    role = "prefill" if request.kv_transfer.WhichOneof("role") == "prefill" else "decode"
    return router.pick(request, role=role).address
