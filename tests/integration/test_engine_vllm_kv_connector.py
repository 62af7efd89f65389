"""The vllm backend hands vLLM's `kv_transfer_params` to vLLM's own KV connector and returns the
connector's answer, on every face: tito.v1 (`kv_transfer.connector_params_json` ->
`kv_connector_params_json`), SMG's (`kv_transfer_params_json` both ways) and the gateway's vLLM
HTTP generate (`kv_transfer_params` both ways), so a router drives a vLLM P/D pair through tito
as it drives vLLM. The connector (tests/support/echo_kv_connector.py, configured by vLLM's own
--kv-transfer-config) moves no KV and answers with what vLLM's scheduler saw on the request.
tito's own router driving a vLLM pair whose KV really moves: test_engine_vllm_pd.py. One vLLM
engine (one start)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc

from tito.grpc_errors import error_details
from tito.kv_params import REMOTE_DECODE
from tito.v1 import engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_gateway.config import GatewayConfig
from tito_gateway.server import create_server as create_gateway

from echo_kv_connector import KV_TRANSFER_CONFIG
from engine_calls import collect, request
from gateway_servers import StoppableGateway
from smg_calls import read_stream, smg_request

pytestmark = pytest.mark.vllm

TIMEOUT = 120
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--kv-transfer-config", KV_TRANSFER_CONFIG)
PROMPT = [(13 * j + 7) % 700 + 30 for j in range(24)]
#: NIXL's prefill request, then a decode handoff in its shape (block ids must stay integers).
PREFILL = REMOTE_DECODE
HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5, 6]],
           "remote_engine_id": "p-engine", "remote_request_id": "r1", "remote_host": "10.0.0.7", "remote_port": 5600,
           "tp_size": 1}


@pytest.fixture(scope="module")
def engine(module_aio_server, tiny_text_model_d64):
    config = EngineConfig(model=str(tiny_text_model_d64), backend="vllm", max_model_len=256,
                          kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS)
    return module_aio_server(lambda: create_server(config))


@pytest.fixture(scope="module")
def gateway_url(module_aio_server, engine) -> str:
    async def start():
        return StoppableGateway(await create_gateway(GatewayConfig(
            address="127.0.0.1:0", render_address="127.0.0.1:9", engine_address=engine.address,
            derender_address="127.0.0.1:9", served_model_name="tiny")))
    return f"http://{module_aio_server(start).address}"


def _answer(seen: dict, max_tokens: int) -> dict:
    return {"seen": seen, "prompt_tokens": len(PROMPT), "max_tokens": max_tokens, "connector": "EchoConnector"}


@pytest.mark.parametrize("params", [PREFILL, HANDOFF])
def test_tito_v1_hands_the_params_to_vllm_and_returns_its_connectors_answer(engine, params):
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel())
    plain, _ = collect(stub.Generate(request(PROMPT, max_tokens=4, ignore_eos=True), timeout=TIMEOUT))
    message = request(PROMPT, max_tokens=4, ignore_eos=True)
    message.kv_transfer.connector_params_json = json.dumps(params)
    tokens, finals = collect(stub.Generate(message, timeout=TIMEOUT))
    assert tokens == plain
    assert json.loads(finals[0].kv_connector_params_json) == _answer(params, 4)


def test_a_tito_role_without_vllms_params_is_refused_by_the_vllm_backend(engine):
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel())
    message = request(PROMPT, max_tokens=2)
    message.kv_transfer.prefill.SetInParent()
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(message, timeout=TIMEOUT))
    details = error_details(caught.value)
    assert details["code"] == grpc.StatusCode.FAILED_PRECONDITION and details["reason"] == "KV_TRANSFER_UNSUPPORTED"


def test_smgs_face_forwards_kv_transfer_params_json_both_ways(engine):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(engine.channel())
    message = smg_request(PROMPT, stream=False, max_tokens=3, ignore_eos=True)
    message.kv_transfer_params_json = json.dumps(HANDOFF)
    complete = read_stream(stub.Generate(message, timeout=TIMEOUT)).completes[0]
    assert json.loads(complete.kv_transfer_params_json) == _answer(HANDOFF, 3)


def test_a_router_drives_prefill_then_decode_through_the_gateway(gateway_url):
    def generate(params: dict) -> dict:
        reply = httpx.post(f"{gateway_url}/inference/v1/generate", timeout=TIMEOUT, json={
            "token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 1}, "kv_transfer_params": params})
        assert reply.status_code == 200, reply.text
        return reply.json()["kv_transfer_params"]

    handoff = generate(PREFILL)
    assert handoff == _answer(PREFILL, 1)
    assert generate(handoff) == _answer(handoff, 1)  # the decode call's params reached vLLM unchanged
