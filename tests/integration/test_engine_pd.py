"""Prefill/decode disaggregation between two real engine servers (port 0): engine P prefills and
pins the prompt's KV, engine D pulls it (PullKvBlocks) and decodes. Greedy tokens equal one
engine's; D's prefix cache saves blocks from the pull; a replayed, expired or forged handle is
refused and the next request works; image chats decode without D's encoder; no KV block stays
pinned afterwards."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client.pipeline import AsyncChatPipeline, ChatPipeline, Endpoints
from tito_client.routing import EngineRouter
from tito_engine.config import EngineConfig
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.server import create_server
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render
from tito_render.convert import chat_response

from chat_parts import image, text
from engine_calls import collect, request
from lora_adapters import ADAPTERS, make_adapter
from renderers import load_renderer

TIMEOUT = 30
BLOCK = 4


def _config(model: Path, key_file: Path, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", engine_process=False, max_model_len=256, block_size=BLOCK,
                        kv_blocks=256, hmac_key_file=str(key_file), **overrides)


@pytest.fixture(scope="module")
def pair(module_aio_server, tiny_text_model, key_file):
    """(P stub, P address, D stub, D address): two engines of the same model sharing the HMAC key."""
    prefill = module_aio_server(lambda: create_server(_config(tiny_text_model, key_file, kv_pin_seconds=5.0)))
    decode = module_aio_server(lambda: create_server(_config(tiny_text_model, key_file)))
    return (engine_pb2_grpc.EngineServiceStub(prefill.channel()), prefill.address,
            engine_pb2_grpc.EngineServiceStub(decode.channel()), decode.address)


def prefill(stub, prompt, **sampling):
    message = request(prompt, **sampling)
    message.kv_transfer.prefill.SetInParent()
    tokens, finals = collect(stub.Generate(message, timeout=TIMEOUT))
    assert finals[0].HasField("kv_transfer_handle")
    return tokens[0], finals[0].kv_transfer_handle


def decode(stub, prompt, handle, address, **sampling):
    message = request(prompt, **sampling)
    message.kv_transfer.decode.handle.CopyFrom(handle)
    message.kv_transfer.decode.source_address = address
    return collect(stub.Generate(message, timeout=TIMEOUT))


def prompts(count: int, length: int = 21) -> list[list[int]]:
    return [[(37 * i + 11 * j + 5) % 900 + 20 for j in range(length + i % 7)] for i in range(count)]


def wait_idle(stub) -> engine_pb2.GetLoadResponse:
    """GetLoad once no block is held (pins included), or the last answer after a few seconds."""
    deadline = time.monotonic() + 10
    while True:
        load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
        if load.kv_blocks_used == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_pd_greedy_tokens_equal_one_engines_and_no_block_leaks(pair):
    p_stub, p_address, d_stub, _ = pair
    for prompt in prompts(32):
        solo, _ = collect(d_stub.Generate(request(prompt, max_tokens=12, ignore_eos=True), timeout=TIMEOUT))
        first, handle = prefill(p_stub, prompt, max_tokens=12, ignore_eos=True)
        assert first == solo[0][:1]  # P computed the first token (and only that)
        assert handle.block_count == -(-len(prompt) // BLOCK) and handle.auth_tag
        tokens, finals = decode(d_stub, prompt, handle, p_address, max_tokens=12, ignore_eos=True)
        assert tokens[0] == solo[0]
        stats = finals[0].kv_transfer_stats
        # D ran the same prompt alone just before: its prefix cache holds every full block but the
        # one with the last token, so only the rest crossed the wire.
        assert stats.blocks_cached == (len(prompt) - 1) // BLOCK
        assert stats.blocks_pulled == handle.block_count - stats.blocks_cached
        block_bytes = 2 * handle.layout.num_layers * BLOCK * handle.layout.kv_heads * handle.layout.head_dim * 4
        assert handle.dtype == "float32" and stats.bytes_pulled == stats.blocks_pulled * block_bytes
    assert wait_idle(p_stub).kv_blocks_used == 0
    assert wait_idle(d_stub).kv_blocks_used == 0


def test_a_prompt_new_to_d_pulls_every_block_and_decodes_the_same(pair):
    p_stub, p_address, d_stub, _ = pair
    d_stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=TIMEOUT)
    prompt = prompts(1, length=40)[0][::-1]
    _, handle = prefill(p_stub, prompt, max_tokens=8, ignore_eos=True)
    tokens, finals = decode(d_stub, prompt, handle, p_address, max_tokens=8, ignore_eos=True)
    assert finals[0].kv_transfer_stats.blocks_cached == 0
    assert finals[0].kv_transfer_stats.blocks_pulled == handle.block_count
    solo, _ = collect(p_stub.Generate(request(prompt, max_tokens=8, ignore_eos=True), timeout=TIMEOUT))
    assert tokens[0] == solo[0]


def _refusal(call) -> dict:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return error_details(caught.value)


def test_replayed_forged_and_expired_handles_are_refused_and_the_next_request_works(pair):
    p_stub, p_address, d_stub, _ = pair
    prompt = prompts(1, length=30)[0]
    _, handle = prefill(p_stub, prompt, max_tokens=4, ignore_eos=True)
    decode(d_stub, prompt, handle, p_address, max_tokens=4, ignore_eos=True)

    replayed = _refusal(lambda: decode(d_stub, prompt, handle, p_address, max_tokens=4))
    assert (replayed["code"], replayed["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                      "KV_TRANSFER_HANDLE_UNKNOWN")

    _, handle = prefill(p_stub, prompt, max_tokens=4, ignore_eos=True)
    forged = engine_pb2.KvTransferHandle()
    forged.CopyFrom(handle)
    forged.transfer_id = "0" * 32  # another request's id, say
    refused = _refusal(lambda: decode(d_stub, prompt, forged, p_address, max_tokens=4))
    assert (refused["code"], refused["reason"]) == (grpc.StatusCode.PERMISSION_DENIED, "KV_TRANSFER_HANDLE_FORGED")
    # Pulled straight from P, past D's check, the forged handle is refused there too.
    pulled = _refusal(lambda: list(p_stub.PullKvBlocks(engine_pb2.PullKvBlocksRequest(handle=forged),
                                                       timeout=TIMEOUT)))
    assert pulled["reason"] == "KV_TRANSFER_HANDLE_FORGED"
    other_prompt = _refusal(lambda: decode(d_stub, prompt[1:], handle, p_address, max_tokens=4))
    assert other_prompt["reason"] == "KV_TRANSFER_MISMATCH"
    # The genuine handle still works after the refusals.
    tokens, _ = decode(d_stub, prompt, handle, p_address, max_tokens=4, ignore_eos=True)
    assert len(tokens[0]) == 4

    expiring = request(prompt, max_tokens=4)
    expiring.kv_transfer.prefill.pin_seconds = 0.2
    _, finals = collect(p_stub.Generate(expiring, timeout=TIMEOUT))
    assert wait_idle(p_stub).kv_blocks_used == 0  # the pin expired and freed its blocks by itself
    expired = _refusal(lambda: decode(d_stub, prompt, finals[0].kv_transfer_handle, p_address, max_tokens=4))
    assert (expired["code"], expired["reason"]) == (grpc.StatusCode.FAILED_PRECONDITION, "KV_TRANSFER_HANDLE_UNKNOWN")

    tokens, _ = collect(d_stub.Generate(request(prompt, max_tokens=4, ignore_eos=True), timeout=TIMEOUT))
    assert len(tokens[0]) == 4
    assert wait_idle(p_stub).kv_blocks_used == 0 and wait_idle(d_stub).kv_blocks_used == 0


def test_the_router_prefills_long_prompts_on_the_prefill_engine_and_decodes_on_the_decode_engine(pair):
    p_stub, p_address, d_stub, d_address = pair
    long_prompt = [(7 * j + 3) % 800 + 50 for j in range(32)]  # shares no block with the other tests' prompts
    short_prompt = prompts(1, length=5)[0]
    # The reference runs on P: run on D, the prompt would be in D's prefix cache, and the router
    # decodes a prompt its decode engine mostly holds there, without a prefill elsewhere.
    solo = {len(prompt): collect(p_stub.Generate(request(prompt, max_tokens=6, ignore_eos=True), timeout=TIMEOUT))[0][0]
            for prompt in (long_prompt, short_prompt)}
    finished_before = p_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).finished_requests

    async def run() -> dict[int, tuple[list[int], engine_pb2.GenerateResponse]]:
        results = {}
        router = EngineRouter([], prefill_engines=[p_address], decode_engines=[d_address], pd_min_prompt_tokens=16,
                              load_interval=0.05).start()
        try:
            async with AsyncChatPipeline(Endpoints("127.0.0.1:1", d_address, "127.0.0.1:1"), timeout=TIMEOUT,
                                         router=router) as pipeline:
                for prompt in (long_prompt, short_prompt):
                    responses = [r async for r in pipeline.generate(request(prompt, max_tokens=6, ignore_eos=True))]
                    results[len(prompt)] = ([t for r in responses for t in r.token_ids], responses[-1])
                    assert pipeline.last_engine == d_address
        finally:
            router.close()
        return results

    results = asyncio.run(run())
    for length, (tokens, last) in results.items():
        assert tokens == solo[length]
    assert results[len(long_prompt)][1].HasField("kv_transfer_stats")  # decoded from pulled KV
    assert not results[len(short_prompt)][1].HasField("kv_transfer_stats")  # too short: one engine
    finished = p_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).finished_requests
    assert finished == finished_before + 1  # only the long prompt was prefilled on P
    assert wait_idle(p_stub).kv_blocks_used == 0


@pytest.fixture(scope="module")
def vl_pair(module_aio_server, tiny_vl_model, key_file):
    """(P stub, P address, D stub) over the tiny vision-language model."""
    def config() -> EngineConfig:
        return EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=False, kv_blocks=512,
                            block_size=BLOCK, hmac_key_file=str(key_file))
    prefill = module_aio_server(lambda: create_server(config()))
    decode = module_aio_server(lambda: create_server(config()))
    return (engine_pb2_grpc.EngineServiceStub(prefill.channel()), prefill.address,
            engine_pb2_grpc.EngineServiceStub(decode.channel()))


def image_chat(renderer, seed: int, images: int) -> engine_pb2.GenerateRequest:
    parts = [text("Look:")]
    for k in range(images):
        parts += [image(56 + 28 * (k % 2), 56, seed=seed + k), text(f"then {k}")]
    parts.append(text("What is it?"))
    rendered = chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=parts)],
        sampling=render_pb2.SamplingOptions(max_tokens=10, temperature=0.0, ignore_eos=True)))
    return rendered.generate_request


def test_pd_image_chats_decode_like_one_engine_without_the_decode_engine_running_its_encoder(vl_pair, tiny_vl_model):
    p_stub, p_address, d_stub = vl_pair
    renderer = load_renderer(tiny_vl_model)
    encoded_on_d = d_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).encoded_items
    for seed, images in ((1, 1), (7, 2), (11, 1), (19, 2)):
        chat = image_chat(renderer, seed, images)
        solo, _ = collect(p_stub.Generate(chat, timeout=TIMEOUT))
        tokens, finals = collect(d_stub.Generate(_split(p_stub, p_address, chat), timeout=TIMEOUT))
        assert tokens[0] == solo[0] and len(tokens[0]) == 10
        # Media prompts pull every block, even those D's cache holds (the same text opens every
        # chat): an import from block 0 is never dropped, so D's encoder never runs.
        assert finals[0].kv_transfer_stats.blocks_pulled == -(-len(chat.token_ids) // BLOCK)
    assert d_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).encoded_items == encoded_on_d
    assert wait_idle(p_stub).kv_blocks_used == 0 and wait_idle(d_stub).kv_blocks_used == 0


def _split(p_stub, p_address: str, chat: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    """Prefill `chat` on P; the decode part that pulls its KV from there."""
    prefill_part = engine_pb2.GenerateRequest()
    prefill_part.CopyFrom(chat)
    prefill_part.kv_transfer.prefill.SetInParent()
    _, finals = collect(p_stub.Generate(prefill_part, timeout=TIMEOUT))
    decode_part = engine_pb2.GenerateRequest()
    decode_part.CopyFrom(chat)
    decode_part.kv_transfer.decode.handle.CopyFrom(finals[0].kv_transfer_handle)
    decode_part.kv_transfer.decode.source_address = p_address
    return decode_part


@pytest.fixture(scope="module")
def lora_pair(module_aio_server, tiny_text_model, key_file, tmp_path_factory):
    """(P stub, P address, D stub) with the same two PEFT adapters loaded on both engines."""
    root = tmp_path_factory.mktemp("pd-lora")
    names = [spec.name for spec in ADAPTERS[:2]]
    for spec in ADAPTERS[:2]:
        make_adapter(tiny_text_model, spec, root / spec.name)
    modules = tuple(f"{name}={name}" for name in names)
    prefill = module_aio_server(lambda: create_server(_config(tiny_text_model, key_file, lora_dir=str(root),
                                                              lora_modules=modules)))
    decode = module_aio_server(lambda: create_server(_config(tiny_text_model, key_file, lora_dir=str(root),
                                                             lora_modules=modules)))
    return (engine_pb2_grpc.EngineServiceStub(prefill.channel()), prefill.address,
            engine_pb2_grpc.EngineServiceStub(decode.channel()), names)


def test_a_prompt_d_holds_under_an_adapter_is_not_pulled_again_and_other_adapters_blocks_never_serve_it(lora_pair):
    p_stub, p_address, d_stub, (first, second) = lora_pair
    prompt = prompts(1, length=33)[0]
    for adapter, cached in ((first, False), (first, True), (second, False), ("", False)):
        chat = request(prompt, max_tokens=8, ignore_eos=True)
        chat.lora_name = adapter
        solo, _ = collect(p_stub.Generate(chat, timeout=TIMEOUT))
        tokens, finals = collect(d_stub.Generate(_split(p_stub, p_address, chat), timeout=TIMEOUT))
        stats = finals[0].kv_transfer_stats
        assert tokens[0] == solo[0], adapter
        assert stats.blocks_cached == ((len(prompt) - 1) // BLOCK if cached else 0), adapter
        assert stats.blocks_pulled == -(-len(prompt) // BLOCK) - stats.blocks_cached
    assert wait_idle(p_stub).kv_blocks_used == 0 and wait_idle(d_stub).kv_blocks_used == 0


def test_engines_that_require_a_token_pull_from_each_other_with_it(aio_server, tiny_text_model, key_file, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("fleet-token-0123456789")
    metadata = [("authorization", "Bearer fleet-token-0123456789")]
    servers = [aio_server(lambda: create_server(_config(tiny_text_model, key_file, auth_token_file=str(token_file))))
               for _ in range(2)]
    p_stub, d_stub = (engine_pb2_grpc.EngineServiceStub(server.channel()) for server in servers)
    prompt = prompts(1, length=26)[0]
    message = request(prompt, max_tokens=5, ignore_eos=True)
    solo, _ = collect(d_stub.Generate(message, timeout=TIMEOUT, metadata=metadata))
    message.kv_transfer.prefill.SetInParent()
    _, finals = collect(p_stub.Generate(message, timeout=TIMEOUT, metadata=metadata))
    message = request(prompt, max_tokens=5, ignore_eos=True)
    message.kv_transfer.decode.handle.CopyFrom(finals[0].kv_transfer_handle)
    message.kv_transfer.decode.source_address = servers[0].address
    tokens, finals = collect(d_stub.Generate(message, timeout=TIMEOUT, metadata=metadata))
    assert tokens[0] == solo[0] and finals[0].kv_transfer_stats.blocks_pulled >= 1


def test_chats_through_render_pd_and_derender_read_as_through_one_engine(pair, aio_server, tiny_text_model):
    p_stub, p_address, d_stub, d_address = pair
    model = str(tiny_text_model)
    render = aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model)))
    derender = aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model)))
    endpoints = Endpoints(render.address, d_address, derender.address)
    question = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="Tell me about the sea and the sky, twice over.")],
        sampling=render_pb2.SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True))

    def text_of(chunks) -> str:
        return "".join(chunk.content for chunk in chunks)

    with ChatPipeline(Endpoints(render.address, p_address, derender.address), timeout=TIMEOUT) as direct:
        expected_text = text_of(direct.stream_chat(question))
    assert expected_text
    finished_before = p_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).finished_requests
    with EngineRouter([], prefill_engines=[p_address], decode_engines=[d_address], pd_min_prompt_tokens=16,
                      load_interval=0.05) as router:
        with ChatPipeline(endpoints, timeout=TIMEOUT, router=router) as routed:
            assert text_of(routed.stream_chat(question)) == expected_text
        d_stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=TIMEOUT)  # D holds the chat now
        deadline = time.monotonic() + 10
        while router.status()[d_address]["cached_blocks"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the router sees the reset through D's KV events

        async def routed_async() -> str:
            async with AsyncChatPipeline(endpoints, timeout=TIMEOUT, router=router) as pipeline:
                return text_of([chunk async for chunk in pipeline.stream_chat(question)])

        assert asyncio.run(routed_async()) == expected_text
    finished = p_stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).finished_requests
    assert finished == finished_before + 2  # both chats were prefilled on P


def test_a_decode_whose_prefill_engine_is_gone_prefills_itself_and_still_answers(pair):
    p_stub, _, d_stub, _ = pair
    prompt = [(13 * j + 7) % 800 + 40 for j in range(27)]
    solo, _ = collect(p_stub.Generate(request(prompt, max_tokens=6, ignore_eos=True), timeout=TIMEOUT))
    _, handle = prefill(p_stub, prompt, max_tokens=6)
    with socket.socket() as probe:  # an address nothing listens on: the prefilling engine died
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    tokens, finals = decode(d_stub, prompt, handle, gone, max_tokens=6, ignore_eos=True)
    assert tokens[0] == solo[0]
    assert finals[0].kv_transfer_stats.blocks_pulled == 0  # computed here instead
    assert wait_idle(d_stub).kv_blocks_used == 0


@pytest.mark.parametrize(("params", "field"), [
    ("[", "kv_transfer.connector_params_json"),
    ('{"do_remote_prefill": true, "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}',
     "kv_transfer_params.tito_kv_handle"),  # a vLLM connector's handoff: no tito handle to pull with
])
def test_vllm_params_a_native_engine_cannot_serve_are_invalid_and_the_next_request_works(pair, params, field):
    _, _, d_stub, _ = pair
    message = request(prompts(1)[0], max_tokens=2)
    message.kv_transfer.connector_params_json = params
    details = _refusal(lambda: list(d_stub.Generate(message, timeout=TIMEOUT)))
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["fields"][0] == field, details
    tokens, _ = collect(d_stub.Generate(request(prompts(1)[0], max_tokens=2), timeout=TIMEOUT))
    assert len(tokens[0]) == 2
