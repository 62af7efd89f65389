"""Continuous batching over real gRPC: many concurrent streams, joins, cancellations, KV accounting.

One engine server (child-process core, as deployed) serves the whole module.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2, engine_pb2_grpc, sampling_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

TIMEOUT = 60
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(tiny_text_model):
    return AutoModelForCausalLM.from_pretrained(tiny_text_model).eval()


@pytest.fixture(scope="module")
def server(module_aio_server, tiny_text_model):
    # 250 blocks of 16 tokens: room for ~60 streams of 64 tokens at once (more wait or are preempted);
    # 16 choices of 253 tokens (256 blocks) can never fit.
    config = EngineConfig(model=str(tiny_text_model), device="cpu", max_running_sequences=128,
                          max_model_len=256, kv_blocks=250, block_size=16, max_prefill_tokens_per_step=256)
    return module_aio_server(lambda: create_server(config))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(10)]


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    with torch.inference_mode():
        return [hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS)[0, len(p):].tolist() for p in prompts]


def greedy_request(prompt, request_id="", **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", NEW_TOKENS)
    sampling.setdefault("ignore_eos", True)
    return engine_pb2.GenerateRequest(request_id=request_id, token_ids=prompt,
                                      sampling_params=sampling_pb2.SamplingParams(**sampling))


async def read_all(stub, request):
    tokens, final, logprobs = [], None, []
    async for response in stub.Generate(request, timeout=TIMEOUT):
        assert final is None, "a message after the final one"
        tokens.extend(response.token_ids)
        logprobs.extend(response.logprobs)
        if response.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            final = response
    return tokens, final, logprobs


async def wait_idle(stub, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
        if (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0) or \
                time.monotonic() > deadline:
            return load
        await asyncio.sleep(0.02)


def run(server, main):
    async def wrapper():
        async with grpc.aio.insecure_channel(server.address) as channel:
            return await main(engine_pb2_grpc.EngineServiceStub(channel))
    return asyncio.run(wrapper())


def test_sixteen_streams_joining_at_different_times_equal_hf(server, prompts, expected):
    async def main(stub):
        async def joining(i):
            await asyncio.sleep(0.004 * i)  # join while the others are mid-stream
            return await read_all(stub, greedy_request(prompts[i % len(prompts)]))

        results = await asyncio.gather(*(joining(i) for i in range(16)))
        return results, await wait_idle(stub)

    results, load = run(server, main)
    for i, (tokens, final, _) in enumerate(results):
        assert tokens == expected[i % len(prompts)], i
        assert final.finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == NEW_TOKENS
    assert (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0)
    assert load.kv_blocks_total == 250 and load.kv_block_size == 16


def test_cancel_50_of_100_streams_at_random_points(server, prompts, expected):
    rng = random.Random(7)
    to_cancel = set(rng.sample(range(100), 50))
    cancel_after = {i: rng.randrange(0, 6) for i in to_cancel}  # messages read before cancelling

    async def main(stub):
        async def cancelled(i):
            call = stub.Generate(greedy_request(prompts[i % len(prompts)], max_tokens=200), timeout=TIMEOUT)
            read = 0
            async for _ in call:
                if read >= cancel_after[i]:
                    break
                read += 1
            call.cancel()

        async def completed(i):
            return i, await read_all(stub, greedy_request(prompts[i % len(prompts)]))

        tasks = [cancelled(i) if i in to_cancel else completed(i) for i in range(100)]
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        return results, await wait_idle(stub)

    results, load = run(server, main)
    assert len(results) == 50
    for i, (tokens, final, _) in results:
        assert tokens == expected[i % len(prompts)], i
        assert final.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0)


def test_logprobs_penalties_and_choices_over_grpc(server, prompts, expected):
    async def main(stub):
        plain = await read_all(stub, greedy_request(prompts[0], logprobs=True, top_logprobs=3))
        seeded = greedy_request(prompts[1], temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3, n=4,
                                presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
        choices = [[], [], [], []]
        async for response in stub.Generate(seeded, timeout=TIMEOUT):
            choices[response.index].extend(response.token_ids)
        again = [[], [], [], []]
        async for response in stub.Generate(seeded, timeout=TIMEOUT):
            again[response.index].extend(response.token_ids)
        return plain, choices, again, await wait_idle(stub)

    (tokens, final, logprobs), choices, again, load = run(server, main)
    assert tokens == expected[0]
    assert len(logprobs) == NEW_TOKENS
    for token, entry in zip(tokens, logprobs):
        assert entry.sampled.token_id == token and entry.sampled.rank == 1 and entry.sampled.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0].token_id == token
        assert [alt.rank for alt in entry.top] == [1, 2, 3]
    assert choices == again and all(len(c) == NEW_TOKENS for c in choices)
    assert len({tuple(c) for c in choices}) > 1
    assert load.kv_blocks_used == 0


def test_a_request_that_can_never_fit_the_kv_cache_is_refused(server):
    async def main(stub):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await read_all(stub, greedy_request([1, 2, 3], n=16, max_tokens=250))
        return exc.value

    error = run(server, main)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--kv-blocks" in error.details()
    details = error_details(error)
    assert details["reason"] == "KV_CACHE_TOO_SMALL" and details["fields"] == ["sampling_params.max_tokens"]


def test_prefix_cache_hits_are_reported_and_salted(server, hf_model):
    prompt = [(17 * i) % 991 for i in range(37)]  # 2 full blocks of 16 before the last token
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                     min_new_tokens=8)[0, len(prompt):].tolist()

    async def main(stub):
        before = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)).prefix_cache_hit_tokens
        first = await read_all(stub, greedy_request(prompt, max_tokens=8))
        second = await read_all(stub, greedy_request(prompt, max_tokens=8))
        salted_request = greedy_request(prompt, max_tokens=8)
        salted_request.cache_salt = "tenant-b"
        salted = await read_all(stub, salted_request)
        after = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)).prefix_cache_hit_tokens
        return first, second, salted, after - before

    first, second, salted, hits = run(server, main)
    assert first[0] == second[0] == salted[0] == expected
    assert (first[1].usage.cached_tokens, second[1].usage.cached_tokens, salted[1].usage.cached_tokens) == (0, 32, 0)
    assert hits == 32
