"""Prefill/decode disaggregation on the engine's SMG face, as SMG's router drives it: the prefill
worker gets `kv_transfer_params_json` {"do_remote_decode": true}, its `complete` carries the
handoff, which the router forwards unchanged to the decode worker. Two real engines: greedy
tokens equal one engine's, the decode engine pulled the KV (a replay is refused), and bad JSON is
refused naming `kv_transfer_params_json` (the mapping is the gateway's: tito.kv_params)."""

from __future__ import annotations

import json

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc

from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from smg_calls import read_stream, smg_request, stream_refusal

TIMEOUT = 30
PREFILL = json.dumps({"do_remote_decode": True})


@pytest.fixture(scope="module")
def pair(module_aio_server, tiny_text_model, key_file):
    """(P's SMG stub, P's address, D's SMG stub): two engines sharing an HMAC key."""

    def engine():
        return create_server(EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False,
                                          max_model_len=256, block_size=4, kv_blocks=256,
                                          hmac_key_file=str(key_file)))

    prefill, decode = module_aio_server(engine), module_aio_server(engine)
    return (vllm_engine_pb2_grpc.VllmEngineStub(prefill.channel()), prefill.address,
            vllm_engine_pb2_grpc.VllmEngineStub(decode.channel()))


def generate(stub, prompt, params: str | None = None, stream: bool = False):
    message = smg_request(prompt, stream=stream, max_tokens=9, ignore_eos=True)
    if params is not None:
        message.kv_transfer_params_json = params
    return stub.Generate(message, timeout=TIMEOUT)


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_then_decode_with_the_forwarded_params_gives_one_engines_tokens(pair, stream):
    p_stub, p_address, d_stub = pair
    prompt = [(13 * j + 7 + stream) % 700 + 30 for j in range(19)]
    solo = read_stream(generate(d_stub, prompt)).tokens()
    prefilled = read_stream(generate(p_stub, prompt, PREFILL, stream))
    assert prefilled.tokens() == solo[:1]
    handoff = prefilled.completes[0].kv_transfer_params_json
    params = json.loads(handoff)
    assert params["do_remote_prefill"] is True
    assert f"{params['remote_host']}:{params['remote_port']}" == p_address
    decoded = read_stream(generate(d_stub, prompt, handoff, stream))
    assert decoded.tokens() == solo
    assert not decoded.completes[0].HasField("kv_transfer_params_json")
    details = stream_refusal(generate(d_stub, prompt, handoff))  # single-use: D pulled it
    assert details["code"] == grpc.StatusCode.FAILED_PRECONDITION
    assert details["fields"][0] == "kv_transfer_params_json.tito_kv_handle"


@pytest.mark.parametrize(("params", "field"), [
    ("{", "kv_transfer_params_json"),
    ("[]", "kv_transfer_params_json"),
    (json.dumps({"do_remote_decode": 1}), "kv_transfer_params_json.do_remote_decode"),
    (json.dumps({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}),
     "kv_transfer_params_json.tito_kv_handle"),
])
def test_bad_params_are_invalid_arguments_naming_the_field(pair, params, field):
    details = stream_refusal(generate(pair[0], [5, 6, 7], params))
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["fields"][0] == field, details
    assert len(read_stream(generate(pair[0], [5, 6, 7])).tokens()) == 9


def test_the_legacy_typed_field_is_refused_by_name(pair):
    message = smg_request([5, 6], stream=False)
    message.kv_transfer_params.remote_host, message.kv_transfer_params.remote_port = "h", 1
    details = stream_refusal(pair[0].Generate(message, timeout=TIMEOUT))
    assert details["reason"] == "UNSUPPORTED_FIELD" and details["fields"][0] == "kv_transfer_params"
