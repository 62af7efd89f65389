"""tito's router drives a pair of vllm-backend engines through vLLM's connector protocol, as vLLM's
own P/D proxies do: the prefill engine's call carries `{"do_remote_decode": true, ...}` with
max_tokens 1, the decode engine's call carries the prefill's connector answer unchanged, and the
client's stream is the decode engine's. The connector (tests/support/echo_kv_connector.py,
`SharedStorageEchoConnector`) is vLLM's ExampleConnector, which moves the prompt's KV through a
shared directory (on vLLM CPU too: whole blocks of all but the prompt's last token, so the prompt
is longer than a block), answering with what it saw on each request. A native prefill engine
does not pair with a vllm-backend decode engine: the decode engine prefills itself. Two vLLM
engines (two starts) and one in-process native engine."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tito.kv_params import REMOTE_DECODE
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_client.pipeline import AsyncChatPipeline, Endpoints
from tito_client.routing import EngineRouter
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from echo_kv_connector import shared_storage_config
from engine_calls import collect, request

pytestmark = pytest.mark.vllm

TIMEOUT = 120
BLOCK = 32  # vLLM CPU's default is 128: ExampleConnector would store no whole block of these prompts
CONNECTOR = "SharedStorageEchoConnector"
#: 70 tokens: ExampleConnector moves its first 64 (two whole blocks); the rest is computed on D.
PROMPT = [(13 * j + 7) % 700 + 30 for j in range(70)]
MOVED_TOKENS = 64


@pytest.fixture(scope="module")
def pair(module_aio_server, tiny_text_model_d64, tmp_path_factory):
    """(P, D): two vllm-backend engines whose connector shares one directory."""
    storage = str(tmp_path_factory.mktemp("kv-store"))
    config = EngineConfig(model=str(tiny_text_model_d64), backend="vllm", max_model_len=256, kv_cache_bytes=32 << 20,
                          block_size=BLOCK, vllm_args=("--dtype", "float32", "--enforce-eager",
                                                       "--kv-transfer-config", shared_storage_config(storage)))
    return tuple(module_aio_server(lambda: create_server(config)) for _ in range(2))


def _routed(prefill_address: str, decode_address: str, prompt: list[int], max_tokens: int
            ) -> tuple[list[int], engine_pb2.GenerateResponse, str]:
    """(tokens, the last response, the engine the client's stream came from) of `prompt` through a
    router with one prefill and one decode engine."""
    async def run():
        router = EngineRouter([], prefill_engines=[prefill_address], decode_engines=[decode_address],
                              pd_min_prompt_tokens=16, load_interval=0.05).start()
        try:
            async with AsyncChatPipeline(Endpoints("127.0.0.1:1", decode_address, "127.0.0.1:1"), timeout=TIMEOUT,
                                         router=router) as pipeline:
                message = request(prompt, request_id="chat-1", max_tokens=max_tokens, ignore_eos=True)
                responses = [response async for response in pipeline.generate(message)]
                return [t for r in responses for t in r.token_ids], responses[-1], pipeline.last_engine
        finally:
            router.close()
    return asyncio.run(run())


def _solo(server, prompt: list[int], max_tokens: int) -> list[int]:
    stub = engine_pb2_grpc.EngineServiceStub(server.channel())
    return collect(stub.Generate(request(prompt, max_tokens=max_tokens, ignore_eos=True), timeout=TIMEOUT))[0][0]


def _info(server) -> engine_pb2.EngineServiceGetModelInfoResponse:
    return engine_pb2_grpc.EngineServiceStub(server.channel()).GetModelInfo(
        engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)


def test_the_router_prefills_on_one_vllm_engine_and_decodes_on_the_other_through_vllms_connector(pair):
    prefill, decode = pair
    for server in pair:  # what the router pairs them by
        info = _info(server)
        assert (info.kv_transfer_protocol, info.kv_connector) == (engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR,
                                                                  CONNECTOR)
    tokens, last, engine = _routed(prefill.address, decode.address, PROMPT, max_tokens=6)
    assert engine == decode.address  # the client's stream is the decode engine's
    decode_saw = json.loads(last.kv_connector_params_json)
    prefill_answer = {"seen": REMOTE_DECODE, "prompt_tokens": len(PROMPT), "max_tokens": 1, "connector": CONNECTOR}
    assert decode_saw == {"seen": prefill_answer, "prompt_tokens": len(PROMPT), "max_tokens": 6,
                          "connector": CONNECTOR}  # P saw vLLM's prefill params, D saw P's answer unchanged
    assert last.usage.cached_tokens == MOVED_TOKENS  # D never met the prompt: its KV came from P's store
    # The reference on P, which computed the prompt itself (it holds it in its prefix cache now).
    assert tokens == _solo(prefill, PROMPT, 6)


def test_a_native_prefill_engine_does_not_pair_with_a_vllm_decode_engine(pair, aio_server, tiny_text_model_d64,
                                                                           caplog):
    reference, decode = pair
    native = aio_server(lambda: create_server(EngineConfig(model=str(tiny_text_model_d64), device="cpu",
                                                           engine_process=False, max_model_len=256)))
    assert _info(native).kv_transfer_protocol == engine_pb2.KV_TRANSFER_PROTOCOL_TITO
    prompt = [(11 * j + 5) % 600 + 40 for j in range(40)]
    with caplog.at_level(logging.WARNING, logger="tito_client.disaggregation"):
        tokens, last, engine = _routed(native.address, decode.address, prompt, max_tokens=5)
    assert engine == decode.address and not last.kv_connector_params_json  # no prefill params reached D
    assert any(f"no prefill engine pairs with decode engine {decode.address}" in record.getMessage()
               for record in caplog.records if record.name == "tito_client.disaggregation")
    native_load = engine_pb2_grpc.EngineServiceStub(native.channel()).GetLoad(engine_pb2.GetLoadRequest(),
                                                                              timeout=TIMEOUT)
    assert native_load.finished_requests == 0  # the native engine was never asked to prefill
    assert tokens == _solo(reference, prompt, 5)
