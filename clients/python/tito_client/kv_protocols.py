"""The two ways a prefill engine hands a prompt's KV to a decode engine, as a router drives them.
An engine says which it speaks (GetModelInfo's kv_transfer_protocol and kv_connector); a router
only pairs engines that speak the same (routing.py), and builds the two parts of a request here:

- tito's (native engines): the prefill part carries KvTransfer.prefill and its stream ends with a
  KvTransferHandle; the decode part carries that handle and where to pull the blocks from.
- vLLM's connector protocol (vllm-backend engines started with vLLM's --kv-transfer-config), as
  vLLM's own P/D proxies drive it: the prefill part carries `{"do_remote_decode": true, ...}`
  (tito.kv_params.REMOTE_DECODE) with max_tokens 1 and no min_tokens; the prefill engine's
  connector answers (GenerateResponse.kv_connector_params_json) and the decode part carries that
  answer unchanged. A prefill without an answer leaves the decode part an ordinary request (the
  decode engine prefills itself), as vLLM's proxies do.

Either way the decode engine streams every token, the first included: the caller sees one
ordinary Generate stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Protocol

from tito import kv_params
from tito.v1 import engine_pb2

log = logging.getLogger(__name__)

TITO = engine_pb2.KV_TRANSFER_PROTOCOL_TITO
VLLM_CONNECTOR = engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR
NONE = engine_pb2.KV_TRANSFER_PROTOCOL_NONE


class KvProtocol(Protocol):
    def prefill_request(self, request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
        """The prefill engine's part of `request`."""

    def decode_request(self, request: engine_pb2.GenerateRequest,
                       prefill_responses: Sequence[engine_pb2.GenerateResponse],
                       source_address: str) -> engine_pb2.GenerateRequest:
        """The decode engine's part of `request`, given what its prefill part answered on the
        engine at `source_address`."""


def _copy(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    part = engine_pb2.GenerateRequest()
    part.CopyFrom(request)
    return part


def _prefill_copy(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    """A copy under an id of its own (a decode engine may run the request's own id meanwhile)."""
    prefill = _copy(request)
    if prefill.request_id:
        prefill.request_id = f"{request.request_id}~prefill"
    return prefill


# ------------------------------------------------------------------------------ tito's

def prefill_request(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    """tito's prefill part: a pin of the prompt's KV (the engine takes max_tokens and n as 1)."""
    prefill = _prefill_copy(request)
    prefill.kv_transfer.prefill.SetInParent()
    return prefill


def decode_request(request: engine_pb2.GenerateRequest, handle: engine_pb2.KvTransferHandle,
                   source_address: str) -> engine_pb2.GenerateRequest:
    """tito's decode part: the same prompt with the handle of its KV."""
    decode = _copy(request)
    decode.kv_transfer.decode.handle.CopyFrom(handle)
    decode.kv_transfer.decode.source_address = source_address
    return decode


def handle_of(responses: Sequence[engine_pb2.GenerateResponse]) -> engine_pb2.KvTransferHandle:
    for response in responses:
        if response.HasField("kv_transfer_handle"):
            return response.kv_transfer_handle
    raise RuntimeError("the prefill engine answered without a KV transfer handle (is it a tito native engine?)")


class TitoTransfer:
    prefill_request = staticmethod(prefill_request)

    @staticmethod
    def decode_request(request, prefill_responses, source_address):
        return decode_request(request, handle_of(prefill_responses), source_address)


# ------------------------------------------------------------------------------ vLLM's connector

def connector_prefill_request(request: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    """vLLM's prefill part: the connector's remote-decode params, one token, one choice."""
    prefill = _prefill_copy(request)
    prefill.kv_transfer.connector_params_json = json.dumps(kv_params.REMOTE_DECODE, separators=(",", ":"))
    sampling = prefill.sampling_params
    sampling.max_tokens = 1
    sampling.n = 1
    sampling.min_tokens = 0  # more than max_tokens would be refused; the decode part keeps it
    return prefill


def connector_answer(responses: Sequence[engine_pb2.GenerateResponse]) -> str:
    """The prefill engine's connector answer (a JSON object), "" when it gave none."""
    for response in reversed(responses):
        if response.kv_connector_params_json:
            return response.kv_connector_params_json
    return ""


class VllmConnectorTransfer:
    prefill_request = staticmethod(connector_prefill_request)

    @staticmethod
    def decode_request(request, prefill_responses, source_address):
        decode = _copy(request)
        answer = connector_answer(prefill_responses)
        if not answer:
            # Not a fault: a connector that shares KV by the prompt's content (vLLM's
            # ExampleConnector) answers nothing and its decode engine finds the KV all the same.
            log.debug("the prefill engine %s answered without KV connector params: the decode call carries none",
                      source_address)
            return decode
        decode.kv_transfer.connector_params_json = answer  # unchanged: the connector reads it, not tito
        return decode


PROTOCOLS: dict[int, KvProtocol] = {TITO: TitoTransfer(), VLLM_CONNECTOR: VllmConnectorTransfer()}


def protocol_name(protocol: int, connector: str = "") -> str:
    """How a log line names a protocol, e.g. "vLLM connector EchoConnector"."""
    if protocol == VLLM_CONNECTOR:
        return f"vLLM connector {connector}" if connector else "vLLM connector"
    return {TITO: "tito", NONE: "none"}.get(protocol, "tito")
