"""vLLM's `kv_transfer_params` JSON <-> tito.v1's typed prefill/decode split (`KvTransfer`).

vLLM-style routers (llm-d's P/D sidecar, SMG, vLLM's own proxy examples) drive prefill/decode
disaggregation with one opaque JSON object: the prefill call carries `{"do_remote_decode": true}`,
the prefill engine answers with the connector's handoff (NIXL's shape: `do_remote_prefill`,
`remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, ...), and the router sends
that object unchanged with the decode call. tito's engines speak the same dance in typed fields,
so this module maps one onto the other; the gateway's vLLM HTTP API and the engine's SMG face both
use it, so the two refuse and answer alike.

The object itself always travels too (`KvTransfer.connector_params_json`): an engine whose KV
moves through vLLM's own connector (the vllm backend) hands it to vLLM unchanged, and that
connector's answer comes back as the next call's object. tito's native engines follow the role:

- `do_remote_decode` true: `KvTransfer.prefill` (the engine's default pin time).
- `do_remote_prefill` true with `tito_kv_handle`: `KvTransfer.decode`, tito's handle carried whole
  (protobuf's JSON form; the engine checks its signature, model and prompt, so a router cannot
  forge one) and the prefilling engine's address in `remote_host` / `remote_port`. Without
  `tito_kv_handle` it is a vLLM connector's handoff: no role (`foreign_decode`; a native engine
  refuses it).
- neither: no role.

NIXL's `remote_block_ids` is never read: tito's handle names its pinned blocks by transfer id, so
no block id list is returned either. Keys vLLM's connectors define beyond NIXL's travel unread.
The keys tito reads are checked: a wrong type is a caller's mistake naming
`kv_transfer_params.<key>`.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from tito.errors import InvalidArgument
from tito.v1 import engine_pb2

FIELD = "kv_transfer_params"
#: Where tito's KvTransferHandle travels inside vLLM's object.
HANDLE_KEY = "tito_kv_handle"
MAX_PORT = 65535
#: What vLLM's own P/D proxies send with a prefill call (NIXL's shape: the connector fills the rest
#: in its answer), and what tito's router sends to a vllm-backend prefill engine.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def invalid(key: str, why: str) -> InvalidArgument:
    name = f"{FIELD}.{key[:64]}" if key else FIELD
    return InvalidArgument(f"{name}: {why}", reason="INVALID_REQUEST", field=name)


def kv_transfer_from_params(params: Any) -> engine_pb2.KvTransfer | None:
    """The typed part a request with vLLM's `params` plays, with `params` themselves for a vLLM
    connector; None for an empty object."""
    if not isinstance(params, dict):
        raise invalid("", "must be an object")
    if not params:
        return None
    transfer = engine_pb2.KvTransfer(connector_params_json=json.dumps(params, separators=(",", ":")))
    remote_decode, remote_prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise invalid("do_remote_prefill", "cannot be true together with do_remote_decode: a request is either "
                                           "the prefill part or the decode part")
    if remote_decode:
        transfer.prefill.SetInParent()
    elif remote_prefill and params.get(HANDLE_KEY) is not None:
        transfer.decode.handle.CopyFrom(_handle(params[HANDLE_KEY]))
        transfer.decode.source_address = _source_address(params)
        engine_id = params.get("remote_engine_id")
        if engine_id is not None and engine_id != transfer.decode.handle.engine_id:
            raise invalid("remote_engine_id", f"must be the engine id of {HANDLE_KEY} (send the prefill answer's "
                                              f"kv_transfer_params unchanged)")
    return transfer


def foreign_decode(params: dict[str, Any]) -> InvalidArgument | None:
    """The refusal of a native engine for `params` that hand over a vLLM connector's KV
    (do_remote_prefill without a tito handle), None for any other."""
    if params.get("do_remote_prefill") is True and params.get(HANDLE_KEY) is None:
        return invalid(HANDLE_KEY, "is required with do_remote_prefill on a tito native engine: send the "
                                   "kv_transfer_params a tito engine's prefill answered (this handoff is a vLLM "
                                   "connector's: decode it on a vllm-backend engine of the same connector)")
    return None


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
        raise invalid(HANDLE_KEY, "must be the object the prefill answer's kv_transfer_params carried, unchanged")
    handle = engine_pb2.KvTransferHandle()
    try:
        json_format.ParseDict(value, handle)
    except json_format.ParseError as error:
        raise invalid(HANDLE_KEY, f"is not a KV transfer handle ({str(error)[:200]})") from None
    if not handle.transfer_id:
        raise invalid(f"{HANDLE_KEY}.transfer_id", "is required")
    return handle
