"""EngineRouter over two real native engines (port 0) serving LoRA adapters: each adapter's second
turn goes to the engine holding its prefix under that adapter (the index keyed on KV events that
name it); an adapter no engine holds is loaded once, on the least loaded engine, however many
first requests arrive at once (through the asyncio pipeline as the gateway runs it, too); a holder
without room sends the adapter to the other engine, which loads it. Every output equals HF +
PEFT's greedy tokens."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_calls import request
from lora_adapters import ADAPTERS, PeftReference, make_adapter
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_client import AsyncChatPipeline, Endpoints, EngineRouter, LoraAdapters
from tito_client.engine_stream import MigratingStream
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from waiting import wait_for

TIMEOUT = 60
BLOCK = 4
CAPACITY = 8  # each engine's max_running_sequences: eight running requests make it full


@dataclass
class Fleet:
    addresses: list[str]  # sorted: the first wins a tie on load
    stubs: dict[str, engine_pb2_grpc.EngineServiceStub]
    adapters: dict[str, LoraAdapters]
    reference: PeftReference  # by the adapters' directory names


@pytest.fixture(scope="module")
def fleet(module_aio_server, tiny_text_model, tmp_path_factory) -> Fleet:
    root = tmp_path_factory.mktemp("lora-routing")
    directories = {spec.name: make_adapter(tiny_text_model, spec, root / spec.name) for spec in ADAPTERS[:2]}
    stubs, adapters = {}, {}
    for _ in range(2):
        config = EngineConfig(address="127.0.0.1:0", model=str(tiny_text_model), device="cpu", engine_process=False,
                              max_model_len=512, block_size=BLOCK, kv_blocks=512, lora_dir=str(root), max_loras=3,
                              max_running_sequences=CAPACITY, max_choices_per_request=1)
        server = module_aio_server(lambda: create_server(config))
        channel = server.channel()
        stubs[server.address] = engine_pb2_grpc.EngineServiceStub(channel)
        adapters[server.address] = LoraAdapters(channel, timeout=TIMEOUT)
    return Fleet(sorted(stubs), stubs, adapters, PeftReference(Path(tiny_text_model), directories))


@pytest.fixture
def slow_loads(monkeypatch):
    """The router's LoadLoraAdapter calls start 0.5 s late (a large adapter on a slow disk): a
    request that did not wait for its adapter's load would reach the engine first and be refused."""
    load = EngineRouter._load_adapter

    def late(router, engine, pending):
        time.sleep(0.5)
        load(router, engine, pending)

    monkeypatch.setattr(EngineRouter, "_load_adapter", late)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


def _message(prompt: list[int], adapter: str, max_tokens: int = 6, **sampling) -> engine_pb2.GenerateRequest:
    message = request(prompt, max_tokens=max_tokens, **sampling)
    message.lora_name = adapter
    return message


def _routed(fleet: Fleet, router: EngineRouter, message) -> tuple[str, list[int], engine_pb2.GenerateResponse]:
    """`message` through the router as a pipeline sends it: (the engine, its tokens, the last response)."""
    address = router.pick(message).address
    stream = MigratingStream(router, lambda where, generate: fleet.stubs[where].Generate(generate, timeout=TIMEOUT),
                             message, address)
    responses = list(stream)
    return stream.address, [token for response in responses for token in response.token_ids], responses[-1]


def _holders(fleet: Fleet, adapter: str) -> list[str]:
    return [address for address in fleet.addresses
            if adapter in {info.name for info in fleet.adapters[address].list()}]


def test_each_adapters_second_turn_goes_to_the_engine_holding_its_prefix(fleet):
    """The same prompt under two adapters, each first turn on a different engine: only an index
    keyed by adapter can tell the two second turns apart, and each is served from its cache."""
    low, high = fleet.addresses
    for address in fleet.addresses:
        fleet.adapters[address].load("turn-attn", "attn-r8")
        fleet.adapters[address].load("turn-mlp", "mlp-r16")
    first_turn = _prompt(1, 6 * BLOCK + 1)
    homes = {"turn-attn": high, "turn-mlp": low}  # "turn-attn" away from the engine that wins ties
    replies = {}
    for adapter, home in homes.items():
        response = list(fleet.stubs[home].Generate(_message(first_turn, adapter), timeout=TIMEOUT))
        replies[adapter] = [token for item in response for token in item.token_ids]
    with EngineRouter(fleet.addresses, load_interval=0.05) as router:
        second_turns = {adapter: first_turn + replies[adapter] + _prompt(2, 3) for adapter in homes}
        for adapter, home in homes.items():
            wait_for(lambda: router.pick(_message(second_turns[adapter], adapter)).address == home,
                      f"{adapter}'s first turn indexed on {home}", timeout=20.0)
        for adapter, home in homes.items():
            address, tokens, final = _routed(fleet, router, _message(second_turns[adapter], adapter))
            assert address == home
            assert final.usage.cached_tokens >= 6 * BLOCK  # its own prefix, from its engine's cache
            directory = {"turn-attn": "attn-r8", "turn-mlp": "mlp-r16"}[adapter]
            assert tokens == fleet.reference.generate(directory, second_turns[adapter], 6)
    for address in fleet.addresses:
        fleet.adapters[address].unload("turn-attn")
        fleet.adapters[address].unload("turn-mlp")


def test_an_adapter_no_engine_holds_is_loaded_once_however_many_first_requests_arrive(fleet, caplog, slow_loads):
    prompts = [_prompt(10 + index, 5 + index) for index in range(6)]
    results: dict[int, tuple[str, list[int]]] = {}
    with EngineRouter(fleet.addresses, load_interval=0.05, lora_paths={"fresh": "attn-r8"}) as router, \
            caplog.at_level(logging.INFO, logger="tito_engine.core.lora_registry"):
        assert _holders(fleet, "fresh") == []

        def first_request(index: int) -> None:
            address, tokens, _ = _routed(fleet, router, _message(prompts[index], "fresh"))
            results[index] = address, tokens

        threads = [threading.Thread(target=first_request, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        loads = [record for record in caplog.records if record.getMessage().startswith("loaded LoRA adapter fresh ")]
    assert len(loads) == 1  # one LoadLoraAdapter for six concurrent first requests
    assert _holders(fleet, "fresh") == [fleet.addresses[0]]  # both idle: the tie goes to the first
    for index, prompt in enumerate(prompts):
        assert results[index] == (fleet.addresses[0], fleet.reference.generate("attn-r8", prompt, 6)), index
    fleet.adapters[fleet.addresses[0]].unload("fresh")


def test_the_asyncio_pipeline_waits_for_the_adapter_its_router_loads(fleet, caplog, slow_loads):
    """What the gateway runs: AsyncChatPipeline.generate over the router, four first requests at
    once for an adapter no engine holds: one load, and every request waits for it."""
    prompts = [_prompt(40 + index, 6 + index) for index in range(4)]

    async def main() -> list[list[int]]:
        async with AsyncChatPipeline(Endpoints("127.0.0.1:1", fleet.addresses[0], "127.0.0.1:1"), timeout=TIMEOUT,
                                     router=router) as pipeline:
            async def one(prompt: list[int]) -> list[int]:
                return [token async for response in pipeline.generate(_message(prompt, "async-fresh"))
                        for token in response.token_ids]

            return await asyncio.gather(*(one(prompt) for prompt in prompts))

    with EngineRouter(fleet.addresses, load_interval=0.05, lora_paths={"async-fresh": "mlp-r16"}) as router, \
            caplog.at_level(logging.INFO, logger="tito_engine.core.lora_registry"):
        outputs = asyncio.run(main())
        loads = [r for r in caplog.records if r.getMessage().startswith("loaded LoRA adapter async-fresh ")]
    assert len(loads) == 1 and _holders(fleet, "async-fresh") == [fleet.addresses[0]]
    assert outputs == [fleet.reference.generate("mlp-r16", prompt, 6) for prompt in prompts]
    fleet.adapters[fleet.addresses[0]].unload("async-fresh")


def test_a_holder_without_room_sends_the_adapter_to_the_other_engine_which_loads_it(fleet):
    low, high = fleet.addresses
    fleet.adapters[low].load("crowded", "mlp-r16")
    long = [fleet.stubs[low].Generate(_message(_prompt(20 + k, 6), "crowded", max_tokens=400, ignore_eos=True),
                                      timeout=TIMEOUT) for k in range(CAPACITY)]
    try:
        for call in long:
            next(call)  # all running: the holder's batch is full
        with EngineRouter(fleet.addresses, load_interval=0.05, lora_paths={"crowded": "mlp-r16"}) as router:
            wait_for(lambda: router.status()[low]["load"] >= CAPACITY, "the holder's full batch polled", timeout=20.0)
            prompt = _prompt(30, 7)
            address, tokens, _ = _routed(fleet, router, _message(prompt, "crowded"))
        assert address == high and _holders(fleet, "crowded") == [low, high]
        assert tokens == fleet.reference.generate("mlp-r16", prompt, 6)
    finally:
        for call in long:
            call.cancel()
    for address in fleet.addresses:  # the cancelled requests finish with it first
        fleet.adapters[address].unload("crowded")
