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


def test_do_remote_decode_is_the_prefill_part_and_neither_flag_is_none():
    assert kv_params.kv_transfer_from_params({"do_remote_decode": True}).WhichOneof("role") == "prefill"
    assert kv_params.kv_transfer_from_params({"do_remote_decode": False, "do_remote_prefill": None}) is None


def test_keys_the_caller_reads_itself_are_allowed_only_when_named():
    with pytest.raises(InvalidArgument) as caught:
        kv_params.kv_transfer_from_params({"prompt_token_ids": [1]})
    assert caught.value.field == "kv_transfer_params.prompt_token_ids"
    assert kv_params.kv_transfer_from_params({"prompt_token_ids": [1]}, frozenset({"prompt_token_ids"})) is None
