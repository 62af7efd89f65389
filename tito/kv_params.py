"""vLLM's `kv_transfer_params` JSON <-> tito.v1's typed prefill/decode split (`KvTransfer`).

vLLM-style routers (llm-d's P/D sidecar, SMG, vLLM's own proxy examples) drive prefill/decode
disaggregation with one opaque JSON object: the prefill call carries `{"do_remote_decode": true}`,
the prefill engine answers with the connector's handoff (NIXL's shape: `do_remote_prefill`,
`remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, ...), and the router sends
that object unchanged with the decode call. tito's engines speak the same dance in typed fields,
so this module maps one onto the other; the gateway's vLLM HTTP API and the engine's SMG face both
use it, so the two refuse and answer alike.

- `do_remote_decode` true: `KvTransfer.prefill` (the engine's default pin time).
- `do_remote_prefill` true: `KvTransfer.decode`, with tito's handle carried whole in
  `tito_kv_handle` (protobuf's JSON form; the engine checks its signature, model and prompt, so a
  router cannot forge one) and the prefilling engine's address in `remote_host` / `remote_port`.
- neither: an ordinary request.

NIXL's `remote_block_ids` is accepted and never read: tito's handle names its pinned blocks by
transfer id, so no block id list is returned either. A key vLLM's connectors do not define is a
caller's mistake naming `kv_transfer_params.<key>`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from tito.errors import InvalidArgument
from tito.v1 import engine_pb2

FIELD = "kv_transfer_params"
#: Where tito's KvTransferHandle travels inside vLLM's object.
HANDLE_KEY = "tito_kv_handle"
#: The keys of vLLM's connector handoff (NIXL's request and answer, the widest shape in vLLM
#: 0.32): accepted; those tito needs are read, the others carry no meaning for tito's engines.
VLLM_KEYS = frozenset(("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
                       "remote_block_ids", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                       "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"))
MAX_PORT = 65535


def invalid(key: str, why: str) -> InvalidArgument:
    name = f"{FIELD}.{key[:64]}" if key else FIELD
    return InvalidArgument(f"{name}: {why}", reason="INVALID_REQUEST", field=name)


def kv_transfer_from_params(params: Any, also_allowed: frozenset[str] = frozenset()) -> engine_pb2.KvTransfer | None:
    """The typed part a request with vLLM's `params` plays, None when it plays none.
    `also_allowed`: keys the caller reads itself (the chat's `prompt_token_ids`)."""
    if not isinstance(params, dict):
        raise invalid("", "must be an object")
    for key in params:
        if key not in VLLM_KEYS and key != HANDLE_KEY and key not in also_allowed:
            raise invalid(key, "unknown key of vLLM's kv_transfer_params")
    remote_decode, remote_prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise invalid("do_remote_prefill", "cannot be true together with do_remote_decode: a request is either "
                                           "the prefill part or the decode part")
    if remote_decode:
        return engine_pb2.KvTransfer(prefill=engine_pb2.KvPrefill())
    if not remote_prefill:
        return None
    transfer = engine_pb2.KvTransfer()
    transfer.decode.handle.CopyFrom(_handle(params.get(HANDLE_KEY)))
    transfer.decode.source_address = _source_address(params)
    engine_id = params.get("remote_engine_id")
    if engine_id is not None and engine_id != transfer.decode.handle.engine_id:
        raise invalid("remote_engine_id", f"must be the engine id of {HANDLE_KEY} (send the prefill answer's "
                                          f"kv_transfer_params unchanged)")
    return transfer


def params_from_handle(handle: engine_pb2.KvTransferHandle, source_address: str) -> dict[str, Any]:
    """A prefill answer's `kv_transfer_params`, in vLLM's shape, for the decode call.
    `source_address`: where the prefilling engine serves EngineService."""
    host, port = split_address(source_address)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": handle.engine_id,
            "remote_request_id": handle.request_id, "remote_host": host, "remote_port": port,
            "remote_num_tokens": handle.num_tokens,
            HANDLE_KEY: json_format.MessageToDict(handle, preserving_proto_field_name=True)}


def split_address(address: str) -> tuple[str, int | None]:
    """"host:port" -> (host, port); an address without a port (a Unix socket) -> (address, None)."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and not host.startswith("unix"):
        return host.removeprefix("[").removesuffix("]"), int(port)
    return address, None


def _source_address(params: dict[str, Any]) -> str:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise invalid("remote_host", "must name the prefilling engine's host (the prefill answer's remote_host)")
    if port is None:
        return host  # a Unix socket address, as params_from_handle writes it
    if type(port) is not int or not 1 <= port <= MAX_PORT:
        raise invalid("remote_port", f"must be an integer port in [1, {MAX_PORT}]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is not None and type(value) is not bool:
        raise invalid(key, "must be a boolean")
    return bool(value)


def _handle(value: Any) -> engine_pb2.KvTransferHandle:
    if not isinstance(value, dict):
        raise invalid(HANDLE_KEY, "is required with do_remote_prefill: the handle the prefill answer's "
                                  "kv_transfer_params carried, unchanged")
    handle = engine_pb2.KvTransferHandle()
    try:
        json_format.ParseDict(value, handle)
    except json_format.ParseError as error:
        raise invalid(HANDLE_KEY, f"is not a KV transfer handle ({str(error)[:200]})") from None
    if not handle.transfer_id:
        raise invalid(f"{HANDLE_KEY}.transfer_id", "is required")
    return handle
