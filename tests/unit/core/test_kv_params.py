"""tito.kv_params: vLLM's kv_transfer_params <-> tito.v1's KvTransfer, shared by the gateway's vLLM
HTTP API and the engine's SMG face."""

from __future__ import annotations

import json

import pytest

from tito import kv_params
from tito.errors import InvalidArgument
from tito.v1 import engine_pb2


def _handle() -> engine_pb2.KvTransferHandle:
    return engine_pb2.KvTransferHandle(
        transfer_id="ab" * 16, request_id="r1", engine_id="engine-1", block_count=3, block_size=4, num_tokens=11,
        dtype="float32", layout=engine_pb2.KvBlockLayout(num_layers=2, kv_heads=1, head_dim=8), expires_at=1.5e9,
        prompt_digest=bytes(range(32)), model_fingerprint="fp", auth_key_id="k", auth_tag=b"\x01" * 32)


@pytest.mark.parametrize("address", ["10.0.0.7:50052", "[::1]:50052", "engine-p.ns.svc:7", "unix:/run/p.sock"])
def test_a_prefill_answers_params_come_back_as_the_same_decode_part(address):
    params = json.loads(json.dumps(kv_params.params_from_handle(_handle(), address)))
    transfer = kv_params.kv_transfer_from_params(params)
    assert transfer.WhichOneof("role") == "decode"
    assert transfer.decode.handle == _handle()
    assert transfer.decode.source_address == address


def test_do_remote_decode_is_the_prefill_part_and_neither_flag_no_part():
    assert kv_params.kv_transfer_from_params({"do_remote_decode": True}).WhichOneof("role") == "prefill"
    assert kv_params.kv_transfer_from_params({"do_remote_decode": False, "do_remote_prefill": None}
                                             ).WhichOneof("role") is None


def test_the_object_travels_whole_for_vllms_connector_and_a_foreign_handoff_has_no_role():
    nixl = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_engine_id": "e", "remote_host": "h",
            "remote_port": 5600, "tp_size": 1}
    transfer = kv_params.kv_transfer_from_params(nixl)
    assert transfer.WhichOneof("role") is None
    assert json.loads(transfer.connector_params_json) == nixl  # block ids stay integers
    assert kv_params.foreign_decode(nixl).field == "kv_transfer_params.tito_kv_handle"
    assert kv_params.foreign_decode({"do_remote_decode": True}) is None
    assert kv_params.kv_transfer_from_params({}) is None


@pytest.mark.parametrize(("params", "field"), [
    ([], "kv_transfer_params"),
    ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x"}, "remote_host": "h", "remote_port": True},
     "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"block_count": -1}, "remote_host": "h", "remote_port": 1},
     "kv_transfer_params.tito_kv_handle"),
])
def test_bad_shapes_name_the_key(params, field):
    with pytest.raises(InvalidArgument) as caught:
        kv_params.kv_transfer_from_params(params)
    assert caught.value.field == field
