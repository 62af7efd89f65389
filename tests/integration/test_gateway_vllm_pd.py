"""Prefill/decode disaggregation driven the way vLLM-style routers drive it (llm-d's P/D sidecar,
SMG, vLLM's own proxies): over vLLM's HTTP generate and over `/v1/chat/completions`, with
`kv_transfer_params`. Two real engines, each behind its own gateway (a router calls the prefill
server, then the decode server with the parameters the prefill answer returned). Greedy tokens
(and a chat's text) equal one engine's; the decode engine pulled the KV (its blocks-pulled
counter grows, and a replay of the same parameters is refused, the handle being single-use); bad
shapes, and a vLLM connector's handoff a native engine cannot decode from, are 400s naming
`kv_transfer_params.<field>`."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway_servers import StoppableGateway
from metrics_scrape import scrape
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_gateway.config import GatewayConfig
from tito_gateway.server import create_server as create_gateway

TIMEOUT = 30
#: llm-d's prefill call, key for key (its sidecar sends NIXL's request shape).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: No render or derender is reached by generate: the gateways name an address nothing serves.
UNUSED = "127.0.0.1:9"


@pytest.fixture(scope="module")
def engine_servers(module_aio_server, tiny_text_model, key_file) -> tuple:
    """(prefill engine, decode engine): two native engines sharing a key, with /metrics."""
    def engine():
        return create_server(EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False,
                                          max_model_len=256, block_size=4, kv_blocks=256, hmac_key_file=str(key_file),
                                          metrics_port=0))

    return module_aio_server(engine), module_aio_server(engine)


@pytest.fixture(scope="module")
def engines(engine_servers) -> tuple[str, str]:
    """(prefill engine address, decode engine address)."""
    return tuple(server.address for server in engine_servers)


@pytest.fixture(scope="module")
def servers(module_aio_server, engines):
    """(prefill gateway URL, decode gateway URL, prefill engine address): one engine behind each,
    for generate only."""
    def gateway(engine_address: str):
        async def start():
            return StoppableGateway(await create_gateway(GatewayConfig(
                address="127.0.0.1:0", render_address=UNUSED, engine_address=engine_address,
                derender_address=UNUSED, served_model_name="tiny")))
        return f"http://{module_aio_server(start).address}"

    prefill, decode = engines
    return gateway(prefill), gateway(decode), prefill


@pytest.fixture(scope="module")
def chat_servers(front, engines):
    """(prefill gateway /v1 URL, decode gateway /v1 URL, prefill engine address): the same engines
    behind gateways with render and derender, for chats."""
    prefill, decode = engines
    return front.gateway(prefill), front.gateway(decode), prefill


def generate(url: str, prompt: list[int], **fields) -> httpx.Response:
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 10, "ignore_eos": True},
            **fields}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=TIMEOUT)


def ok(reply: httpx.Response) -> dict:
    assert reply.status_code == 200, reply.text
    return reply.json()


def prompts(count: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 3) % 800 + 40 for j in range(17 + 3 * i)] for i in range(count)]


def test_prefill_then_decode_with_the_returned_params_gives_one_engines_tokens(servers):
    prefill_url, decode_url, prefill_address = servers
    for prompt in prompts(4):
        solo = ok(generate(prefill_url, prompt))["choices"][0]["token_ids"]
        first = ok(generate(prefill_url, prompt, kv_transfer_params=PREFILL_PARAMS))
        assert first["choices"][0]["token_ids"] == solo[:1]  # P ran to the first token only
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert f"{params['remote_host']}:{params['remote_port']}" == prefill_address
        assert params["remote_engine_id"] == params["tito_kv_handle"]["engine_id"]
        params = json.loads(json.dumps(params))  # as a router forwards it: JSON, unchanged
        decoded = ok(generate(decode_url, prompt, kv_transfer_params=params))
        assert decoded["choices"][0]["token_ids"] == solo
        assert decoded["kv_transfer_params"] is None
        assert_spent(generate(decode_url, prompt, kv_transfer_params=params))


def assert_spent(replay) -> None:
    """The decode engine pulled the blocks: the handle is spent, so a replay is refused."""
    assert replay.status_code == 400, replay.text
    assert replay.json()["error"]["param"] == "kv_transfer_params.tito_kv_handle"


def test_a_streamed_prefill_carries_the_params_on_its_last_chunk(servers):
    prefill_url, decode_url, _ = servers
    prompt = prompts(5)[-1]
    solo = ok(generate(decode_url, prompt))["choices"][0]["token_ids"]
    reply = generate(prefill_url, prompt, kv_transfer_params=PREFILL_PARAMS, stream=True)
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.split("\n\n")
              if line.startswith("data: {")]
    params = [chunk["kv_transfer_params"] for chunk in chunks if "kv_transfer_params" in chunk]
    assert len(params) == 1 and chunks[-1]["choices"][0]["finish_reason"] is not None
    assert ok(generate(decode_url, prompt, kv_transfer_params=params[0]))["choices"][0]["token_ids"] == solo


def test_a_decode_for_another_prompt_is_refused_and_the_next_request_works(servers):
    prefill_url, decode_url, _ = servers
    prompt = prompts(6)[-1]
    params = ok(generate(prefill_url, prompt, kv_transfer_params=PREFILL_PARAMS))["kv_transfer_params"]
    other = generate(decode_url, prompt[:-1] + [prompt[-1] + 1], kv_transfer_params=params)
    assert other.status_code == 400 and other.json()["error"]["param"].startswith("kv_transfer_params.tito_kv_handle")
    assert len(ok(generate(decode_url, prompt, kv_transfer_params=params))["choices"][0]["token_ids"]) == 10


#: Bad `kv_transfer_params` and the field each 400 names, on generate and on the chat alike.
BAD_PARAMS = [
    ("yes", "kv_transfer_params"),
    ({"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}, "kv_transfer_params.tito_kv_handle"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x", "surprise": 1}, "remote_host": "h",
      "remote_port": 1}, "kv_transfer_params.tito_kv_handle"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x"}, "remote_port": 1},
     "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x"}, "remote_host": "h", "remote_port": 70000},
     "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x", "engine_id": "a"}, "remote_host": "h",
      "remote_port": 1, "remote_engine_id": "b"}, "kv_transfer_params.remote_engine_id"),
    # A vLLM connector's decode handoff (NIXL's shape) reaches a native engine: refused there.
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e", "remote_host": "h",
      "remote_port": 1}, "kv_transfer_params.tito_kv_handle"),
]


@pytest.mark.parametrize(("params", "param"), BAD_PARAMS)
def test_bad_params_are_400s_naming_the_field(servers, params, param):
    reply = generate(servers[0], [40, 41, 42], kv_transfer_params=params)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# -- the same split over /v1/chat/completions (vLLM's P/D proxies: max_tokens 1 on the prefill) ----

def chat(url: str, content: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 10, "ignore_eos": True, **fields}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=TIMEOUT)


def text_of(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def blocks_pulled(engine) -> float:
    return scrape(engine).get(("tito_engine_kv_transfer_blocks_pulled_total", ()), 0.0)


def test_a_chat_prefilled_behind_one_gateway_decodes_behind_another_as_the_plain_chat(chat_servers,
                                                                                       engine_servers):
    prefill_url, decode_url, prefill_address = chat_servers
    decode_engine = engine_servers[1]
    for content in ("Tell me about the sea and its many boats", "Count the stars in the winter sky for me"):
        plain = ok(chat(prefill_url, content))
        first = ok(chat(prefill_url, content, max_tokens=1, kv_transfer_params=PREFILL_PARAMS))
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["tito_kv_handle"]["transfer_id"]
        assert f"{params['remote_host']}:{params['remote_port']}" == prefill_address
        params = json.loads(json.dumps(params))  # as a router forwards it
        pulled = blocks_pulled(decode_engine)
        decoded = ok(chat(decode_url, content, kv_transfer_params=params))
        assert text_of(decoded) == text_of(plain) and decoded["usage"] == plain["usage"]
        assert blocks_pulled(decode_engine) > pulled  # the decode engine took the prompt's KV from the prefill
        assert decoded["kv_transfer_params"] is None
        assert_spent(chat(decode_url, content, kv_transfer_params=params))


def test_a_streamed_prefill_chat_hands_off_and_a_decode_chat_reuses_the_rendered_ids(chat_servers):
    prefill_url, decode_url, _ = chat_servers
    content = "Write a short line about green hills"
    plain = ok(chat(prefill_url, content))
    reply = chat(prefill_url, content, max_tokens=1, stream=True, kv_transfer_params=PREFILL_PARAMS)
    events = [json.loads(line[len("data: "):]) for line in reply.text.split("\n\n") if line.startswith("data: {")]
    handed = [event["kv_transfer_params"] for event in events if "kv_transfer_params" in event]
    assert len(handed) == 1
    # The decode side's router rendered the chat already: its ids travel with the handle.
    rendered = httpx.post(f"{decode_url}/chat/completions/render", timeout=TIMEOUT, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 10,
        "ignore_eos": True}).json()
    decoded = ok(chat(decode_url, content, kv_transfer_params={**handed[0],
                                                               "prompt_token_ids": rendered["token_ids"]}))
    assert text_of(decoded) == text_of(plain)


def test_a_completion_prefilled_behind_one_gateway_decodes_behind_another(chat_servers):
    prefill_url, decode_url, _ = chat_servers
    body = {"model": "tiny", "prompt": "Once upon a time in a quiet town", "temperature": 0, "max_tokens": 10,
            "ignore_eos": True}

    def complete(url: str, **fields) -> dict:
        return ok(httpx.post(f"{url}/completions", json={**body, **fields}, timeout=TIMEOUT))

    plain = complete(prefill_url)
    params = complete(prefill_url, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)["kv_transfer_params"]
    decoded = complete(decode_url, kv_transfer_params=params)
    assert decoded["choices"][0]["text"] == plain["choices"][0]["text"] and decoded["kv_transfer_params"] is None


@pytest.mark.parametrize(("params", "param"), BAD_PARAMS)
def test_bad_params_on_the_chat_are_400s_naming_the_field(chat_servers, params, param):
    reply = chat(chat_servers[0], "Hello there", kv_transfer_params=params)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_cache_salt_reaches_the_engines_prefix_cache_from_the_chat(chat_servers):
    url = chat_servers[1]
    content = "A chat whose prefix is cached under one salt only"

    def cached(salt: str) -> int:
        return ok(chat(url, content, cache_salt=salt))["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same salt: the prefix is the engine's
    assert cached("tenant-b") == 0  # another salt keys other blocks
