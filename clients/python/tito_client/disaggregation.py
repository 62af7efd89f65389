"""Prefill/decode disaggregation from the router's side: a long prompt is prefilled on a prefill
engine, then decoded on a decode engine that takes the prompt's KV from it, in the protocol both
speak (kv_protocols.py: tito's handles, or vLLM's connector params). The decode engine streams
every token, the first included, so the caller sees one ordinary Generate stream.

A prompt goes to one engine unchanged when the router does not disaggregate it (routing.py:
shorter than its threshold, or no prefill engines), when its decode engine takes no part in
splits (a vllm-backend engine without vLLM's --kv-transfer-config), when no prefill engine speaks
its decode engine's protocol (a native prefill engine beside a vllm-backend decode engine, or two
different vLLM connectors: logged once per decode engine), and when its prefill engine went away
(the decode engine then prefills it itself)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from tito.v1 import engine_pb2

from tito_client.kv_protocols import NONE, PROTOCOLS, protocol_name
from tito_client.migration import engine_gone
from tito_client.routing import Choice, EngineRouter, NoEngineAvailable

log = logging.getLogger(__name__)

#: Runs the prefill call on the engine at an address: (address, request) -> its responses.
Prefill = Callable[[str, engine_pb2.GenerateRequest], Awaitable[Sequence[engine_pb2.GenerateResponse]]]
BlockingPrefill = Callable[[str, engine_pb2.GenerateRequest], Sequence[engine_pb2.GenerateResponse]]


def _plan(router: EngineRouter, request: engine_pb2.GenerateRequest) -> tuple[Choice, Choice | None]:
    """(the decode engine, the prefill engine or None when `request` is not split there)."""
    decode = router.pick(request)
    if decode.kv_protocol == NONE or not router.disaggregates(request, decode):
        return decode, None
    try:
        return decode, router.pick(request, role="prefill", pair_with=decode)
    except NoEngineAvailable as unpaired:
        if router.first_time(f"unpaired {decode.address}"):
            log.warning("no prefill engine pairs with decode engine %s (%s): its requests are prefilled where "
                        "they decode (%s)", decode.address, protocol_name(decode.kv_protocol, decode.kv_connector),
                        unpaired)
        return decode, None


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
        return decode.address, request
    protocol = PROTOCOLS[decode.kv_protocol]
    try:
        with router.track(source.address):
            responses = await prefill(source.address, protocol.prefill_request(request))
    except grpc.RpcError as error:
        _fell_back(error, source.address)
        return decode.address, request
    return decode.address, protocol.decode_request(request, responses, source.address)


def place_blocking(router: EngineRouter, request: engine_pb2.GenerateRequest, prefill: BlockingPrefill
                   ) -> tuple[str, engine_pb2.GenerateRequest]:
    """`place` for synchronous callers (ChatPipeline)."""
    if request.HasField("kv_transfer"):
        return _part_engine(router, request), request
    decode, source = _plan(router, request)
    if source is None:
        return decode.address, request
    protocol = PROTOCOLS[decode.kv_protocol]
    try:
        with router.track(source.address):
            responses = prefill(source.address, protocol.prefill_request(request))
    except grpc.RpcError as error:
        _fell_back(error, source.address)
        return decode.address, request
    return decode.address, protocol.decode_request(request, responses, source.address)


def _part_engine(router: EngineRouter, request: engine_pb2.GenerateRequest) -> str:
    role = "prefill" if request.kv_transfer.WhichOneof("role") == "prefill" else "decode"
    return router.pick(request, role=role).address
