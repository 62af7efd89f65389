"""LoRA adapters through the engine's gRPC service (native backend, port 0), against HF + PEFT.

For the tiny Qwen2 and Llama, three PEFT adapters made here (seeded non-zero lora_B; ranks 8 and
16; attention, MLP, and every projection with rslora) are loaded at start (--lora-modules): greedy
tokens under each adapter alone, and under all three and the base model in one batch of 16 rows
arriving staggered, equal PEFT's `generate`; so do image prompts under two adapters of the tiny
Qwen2-VL's language model. Adapters loaded at run time survive a restart of the engine core. The
prefix cache keys blocks by adapter (a prompt
computed under one adapter is computed again under another, reused under the same one) and KV
events name it. Then the refusals, each a clear status that leaves the engine serving: an unknown
adapter, a path outside --lora-dir, missing and corrupt files, an adapter of another base, a rank
over the limit, two loads of one name at once, all slots busy; and unloading an adapter in use
(its request finishes, new ones are refused), the least recently used idle adapter giving its slot.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from chat_parts import image, text
from engine_calls import collect, request
from lora_adapters import ADAPTERS, AdapterSpec, PeftReference, make_adapter, q_proj_adapter, write_adapter
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client import LoraAdapters
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.convert import chat_response

TIMEOUT = 60
BLOCK = 4
NAMES = [spec.name for spec in ADAPTERS]


@dataclass
class Served:
    """An engine serving a tiny model with the three test adapters, and PEFT's reference."""

    stub: engine_pb2_grpc.EngineServiceStub
    adapters: LoraAdapters
    reference: PeftReference
    model_dir: Path
    root: Path
    address: str = ""


def _prompt(seed: int, length: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(length)]


def _generate(stub, prompt, lora_name="", max_tokens=8, **sampling):
    message = request(prompt, max_tokens=max_tokens, **sampling)
    message.lora_name = lora_name
    tokens, finals = collect(stub.Generate(message, timeout=TIMEOUT))
    return tokens[0], finals[0]


def _serve(start, model_dir: Path, root: Path, **overrides) -> tuple[engine_pb2_grpc.EngineServiceStub, grpc.Channel]:
    settings = dict(model=str(model_dir), device="cpu", engine_process=False, max_model_len=256, block_size=BLOCK,
                    kv_blocks=512, lora_dir=str(root))
    settings.update(overrides)
    server = start(lambda: create_server(EngineConfig(**settings)))
    channel = server.channel()
    return engine_pb2_grpc.EngineServiceStub(channel), channel


def _served(start, model_dir: Path, root: Path) -> Served:
    directories = {spec.name: make_adapter(model_dir, spec, root / spec.name) for spec in ADAPTERS}
    stub, channel = _serve(start, model_dir, root, max_loras=3,
                           lora_modules=tuple(f"{name}={name}" for name in directories))
    return Served(stub, LoraAdapters(channel, timeout=TIMEOUT), PeftReference(model_dir, directories), model_dir,
                  root, channel._channel.target().decode())


@pytest.fixture(scope="module")
def qwen2(module_aio_server, tiny_text_model, tmp_path_factory) -> Served:
    return _served(module_aio_server, tiny_text_model, tmp_path_factory.mktemp("lora-qwen2"))


@pytest.fixture(scope="module")
def llama(module_aio_server, tiny_llama_model, tmp_path_factory) -> Served:
    return _served(module_aio_server, tiny_llama_model, tmp_path_factory.mktemp("lora-llama"))


@pytest.fixture(params=["qwen2", "llama"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


def _refusal(call) -> dict:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return error_details(caught.value)


# ---------------------------------------------------------------------------- equal to HF + PEFT


def test_each_adapter_alone_equals_peft_and_changes_the_tokens(served):
    prompt = _prompt(1)
    outputs = {}
    for name in [None, *NAMES]:
        tokens, _ = _generate(served.stub, prompt, name or "")
        assert tokens == served.reference.generate(name, prompt, 8), name
        outputs[name] = tuple(tokens)
    assert len(set(outputs.values())) == 4, outputs  # each adapter is applied, and to its rows only


def test_three_adapters_and_the_base_in_one_batch_of_16_staggered(served):
    jobs = [(name, _prompt(100 + index, 6 + index)) for index in range(4) for name in [None, *NAMES]]
    results: dict[int, list[int]] = {}

    def run(index: int, name: str | None, prompt: list[int]) -> None:
        time.sleep(0.004 * index)  # staggered arrivals: rows join while others prefill and decode
        results[index] = _generate(served.stub, prompt, name or "", max_tokens=8)[0]

    threads = [threading.Thread(target=run, args=(index, *job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    for index, (name, prompt) in enumerate(jobs):
        assert results[index] == served.reference.generate(name, prompt, 8), (index, name)


# ---------------------------------------------------------------------------- the prefix cache


def test_the_prefix_cache_keys_blocks_by_adapter_and_events_name_it(qwen2):
    prompt = _prompt(7, 6 * BLOCK + 1)
    cacheable = 6 * BLOCK
    first, second = NAMES[0], NAMES[1]
    assert _generate(qwen2.stub, prompt, first)[1].usage.cached_tokens == 0
    assert _generate(qwen2.stub, prompt, second)[1].usage.cached_tokens == 0  # computed again
    assert _generate(qwen2.stub, prompt)[1].usage.cached_tokens == 0  # nor does the base model reuse them
    assert _generate(qwen2.stub, prompt, first)[1].usage.cached_tokens == cacheable  # reused
    assert _generate(qwen2.stub, prompt)[1].usage.cached_tokens == cacheable

    stored_under: dict[str, set[bytes]] = {}
    stream = qwen2.stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT)
    want = prompt[:cacheable]
    try:
        for batch in stream:
            for event in batch.events:
                stored = event.block_stored
                if event.WhichOneof("event") == "block_stored" and list(stored.token_ids) == want:
                    stored_under.setdefault(stored.lora_name, set()).update(stored.block_hashes)
            if len(stored_under) == 3:
                break
    finally:
        stream.cancel()
    assert set(stored_under) == {first, second, ""}
    # The same tokens under three adapters: three chains of blocks, none shared.
    assert sum(len(hashes) for hashes in stored_under.values()) == len(set().union(*stored_under.values()))


# ---------------------------------------------------------------------------- what the engine reports


def test_adapters_act_on_a_vision_language_models_language_model(module_aio_server, tiny_vl_model, renderer,
                                                                  tmp_path_factory):
    """The tiny Qwen2-VL with two PEFT adapters on its language model: image prompts under each
    adapter and the base model, alone and together in one batch, give HF + PEFT's greedy tokens."""
    root = tmp_path_factory.mktemp("lora-vl")
    specs = [AdapterSpec("vl-attn", 8, ("q_proj", "v_proj"), seed=5),
             AdapterSpec("vl-all", 16, ADAPTERS[2].targets, seed=6, rslora=True)]
    directories = {spec.name: make_adapter(tiny_vl_model, spec, root / spec.name) for spec in specs}
    stub, _ = _serve(module_aio_server, tiny_vl_model, root, max_loras=2,
                     lora_modules=tuple(f"{name}={name}" for name in directories))
    reference = PeftReference(tiny_vl_model, directories)
    jobs = []
    for index, name in enumerate([None, "vl-attn", "vl-all"] * 2):
        rendered = chat_response(renderer, render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content_parts=[
                image(56 + 28 * (index % 2), 56, seed=index), text(f"What is in picture {index}?")])],
            sampling=render_pb2.SamplingOptions(max_tokens=8, temperature=0.0))).generate_request
        rendered.lora_name = name or ""
        jobs.append((name, rendered))
    expected = [reference.generate_rendered(name, rendered) for name, rendered in jobs]
    assert len({tuple(tokens) for tokens in expected[:3]}) == 3  # each adapter changes the tokens
    alone = [collect(stub.Generate(rendered, timeout=TIMEOUT))[0][0] for _, rendered in jobs]
    assert alone == expected
    together: dict[int, list[int]] = {}

    def run(index: int) -> None:
        together[index] = collect(stub.Generate(jobs[index][1], timeout=TIMEOUT))[0][0]

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert [together.get(index) for index in range(len(jobs))] == expected


def test_model_info_list_and_load_name_the_adapters(qwen2):
    info = qwen2.stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert (info.max_loras, info.max_lora_rank) == (3, 16)
    by_name = {adapter.name: adapter for adapter in info.lora_adapters}
    assert set(by_name) == set(NAMES)
    assert (by_name["attn-r8"].rank, list(by_name["attn-r8"].target_modules)) == (8, ["q_proj", "v_proj"])
    assert by_name["all-r16"].path == "all-r16" and by_name["all-r16"].resident
    assert [adapter.name for adapter in qwen2.adapters.list()] == sorted(NAMES)
    load = qwen2.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert sorted(adapter.name for adapter in load.lora_adapters) == sorted(NAMES)


# ---------------------------------------------------------------------------- refusals


def test_an_unknown_adapter_is_not_found_by_name(qwen2):
    details = _refusal(lambda: _generate(qwen2.stub, _prompt(3), "no-such-adapter"))
    assert (details["code"], details["reason"], details["fields"]) == (
        grpc.StatusCode.NOT_FOUND, "LORA_ADAPTER_NOT_FOUND", ["lora_name"])
    assert "no-such-adapter" in details["message"]
    assert _generate(qwen2.stub, _prompt(3))[0]  # the engine serves on


@pytest.mark.parametrize("case", ["outside", "absolute", "missing", "corrupt", "other-base", "layer-past-the-model",
                                  "rank"])
def test_a_bad_adapter_is_refused_naming_why(qwen2, case, tmp_path):
    root = qwen2.root
    if case == "outside":
        path, expected = "../" + tmp_path.name, ("INVALID_ARGUMENT", "LORA_PATH_NOT_ALLOWED")
    elif case == "absolute":
        path, expected = str(tmp_path), ("INVALID_ARGUMENT", "LORA_PATH_NOT_ALLOWED")
    elif case == "missing":
        (root / "empty").mkdir(exist_ok=True)
        path, expected = "empty", ("INVALID_ARGUMENT", "LORA_ADAPTER_INVALID")
    elif case == "corrupt":
        path = write_adapter(root / "corrupt", *q_proj_adapter(64))
        (root / path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        expected = ("INVALID_ARGUMENT", "LORA_ADAPTER_INVALID")
    elif case == "other-base":  # trained for a model of hidden size 128
        path, expected = write_adapter(root / "wide", *q_proj_adapter(128)), ("INVALID_ARGUMENT", "LORA_BASE_MISMATCH")
    elif case == "layer-past-the-model":
        path = write_adapter(root / "deep", *q_proj_adapter(64, layer=7))
        expected = ("INVALID_ARGUMENT", "LORA_BASE_MISMATCH")
    else:
        spec = AdapterSpec("big", 32, ("q_proj",), seed=4)
        path = make_adapter(qwen2.model_dir, spec, root / "rank32").name
        expected = ("INVALID_ARGUMENT", "LORA_RANK_TOO_LARGE")
    details = _refusal(lambda: qwen2.adapters.load(f"bad-{case}", path))
    assert (details["code"].name, details["reason"]) == expected, details
    assert details["fields"] == ["lora_path"]
    assert "bad-" + case not in [adapter.name for adapter in qwen2.adapters.list()]
    assert _generate(qwen2.stub, _prompt(5), NAMES[0])[0]


# ---------------------------------------------------------------------------- loading at run time


@pytest.fixture
def two_slots(aio_server, tiny_text_model, tmp_path) -> Served:
    """An engine with two adapter slots and none loaded; adapters a, b, c under its --lora-dir."""
    specs = [AdapterSpec(name, 8, ("q_proj", "v_proj", "down_proj"), seed=10 + index)
             for index, name in enumerate("abc")]
    directories = {spec.name: make_adapter(tiny_text_model, spec, tmp_path / spec.name) for spec in specs}
    stub, channel = _serve(aio_server, tiny_text_model, tmp_path, max_loras=2)
    return Served(stub, LoraAdapters(channel, timeout=TIMEOUT), PeftReference(tiny_text_model, directories),
                  tiny_text_model, tmp_path)


def _start_long(stub, prompt, name) -> tuple[threading.Thread, dict]:
    """A Generate of 200 tokens under `name` on a thread; returns once its first token arrived."""
    result: dict = {}
    started = threading.Event()

    def run() -> None:
        message = request(prompt, max_tokens=200, ignore_eos=True)
        message.lora_name = name
        tokens = []
        for response in stub.Generate(message, timeout=TIMEOUT):
            tokens.extend(response.token_ids)
            started.set()
            if response.finish_reason:
                result["finish"] = response.finish_reason
        result["tokens"] = tokens

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(TIMEOUT)
    return thread, result


def test_unloading_an_adapter_in_use_lets_its_request_finish_and_refuses_new_ones(two_slots):
    two_slots.adapters.load("a", "a")
    prompt = _prompt(11)
    thread, result = _start_long(two_slots.stub, prompt, "a")
    assert two_slots.adapters.unload("a") == 1
    details = _refusal(lambda: _generate(two_slots.stub, prompt, "a"))
    assert (details["code"], details["reason"]) == (grpc.StatusCode.NOT_FOUND, "LORA_ADAPTER_NOT_FOUND")
    details = _refusal(lambda: two_slots.adapters.load("a", "a"))  # not while its request runs
    assert (details["code"], details["reason"]) == (grpc.StatusCode.ALREADY_EXISTS, "LORA_ADAPTER_EXISTS")
    thread.join(TIMEOUT)
    assert result["finish"] == engine_pb2.FINISH_REASON_LENGTH and len(result["tokens"]) == 200
    assert two_slots.adapters.list() == []
    two_slots.adapters.load("a", "a")  # its slot is free again
    assert _generate(two_slots.stub, prompt, "a")[0] == two_slots.reference.generate("a", prompt, 8)


def test_slots_go_to_the_least_recently_used_idle_adapter_and_busy_slots_refuse(two_slots):
    prompt = _prompt(12)
    two_slots.adapters.load("a", "a")
    two_slots.adapters.load("b", "b")
    running = [_start_long(two_slots.stub, prompt, name) for name in ("a", "b")]
    details = _refusal(lambda: two_slots.adapters.load("c", "c"))
    assert (details["code"], details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "LORA_SLOTS_BUSY")
    for thread, _ in running:
        thread.join(TIMEOUT)
    _generate(two_slots.stub, prompt, "a")  # b is now the least recently used
    assert two_slots.adapters.load("c", "c").resident
    resident = {adapter.name: adapter.resident for adapter in two_slots.adapters.list()}
    assert resident == {"a": True, "b": False, "c": True}
    # b is still held: a request for it takes a slot back (from a, now the least recently used).
    for name in ("b", "c", "a"):
        assert _generate(two_slots.stub, prompt, name)[0] == two_slots.reference.generate(name, prompt, 8), name


def test_two_loads_of_one_name_at_once_one_wins(two_slots):
    codes = []

    def load() -> None:
        try:
            two_slots.adapters.load("a", "a")
            codes.append("OK")
        except grpc.RpcError as error:
            codes.append(error_details(error)["reason"])

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert sorted(codes) == ["LORA_ADAPTER_EXISTS", "OK"]
    assert [adapter.name for adapter in two_slots.adapters.list()] == ["a"]


def test_adapters_loaded_at_run_time_survive_a_restart_of_the_engine_core(aio_server, qwen2):
    """The model process dies; the one that replaces it holds what the lost one held: the
    --lora-modules adapters still loaded and those loaded at run time (not one unloaded before)."""
    import multiprocessing

    before = {child.pid for child in multiprocessing.active_children()}
    stub, channel = _serve(aio_server, qwen2.model_dir, qwen2.root, engine_process=True, max_loras=3,
                           lora_modules=("attn-r8=attn-r8", "mlp-r16=mlp-r16"))
    adapters = LoraAdapters(channel, timeout=TIMEOUT)
    adapters.load("late", "all-r16")
    adapters.unload("mlp-r16")
    prompt = _prompt(21)
    expected = _generate(stub, prompt, "late")[0]
    assert expected == qwen2.reference.generate("all-r16", prompt, 8)
    (core,) = [child for child in multiprocessing.active_children()
               if child.name == "tito-engine-core" and child.pid not in before]
    core.kill()

    def served_again() -> bool:
        try:
            return _generate(stub, prompt, "late")[0] == expected
        except grpc.RpcError as error:  # ENGINE_CORE_LOST while the new core loads
            assert error_details(error)["reason"] == "ENGINE_CORE_LOST", error
            return False

    deadline = time.monotonic() + 120
    while not served_again():
        assert time.monotonic() < deadline, "the new core never served the run-time adapter"
        time.sleep(0.2)
    assert [(a.name, a.path) for a in adapters.list()] == [("attn-r8", "attn-r8"), ("late", "all-r16")]
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert sorted(adapter.name for adapter in load.lora_adapters) == ["attn-r8", "late"]
    assert _generate(stub, prompt, "attn-r8")[0] == qwen2.reference.generate("attn-r8", prompt, 8)


def test_an_engine_without_lora_dir_refuses_adapters(aio_server, tiny_text_model, tmp_path):
    stub, channel = _serve(aio_server, tiny_text_model, tmp_path, lora_dir="")
    details = _refusal(lambda: _generate(stub, _prompt(2), "a"))
    assert (details["code"], details["reason"], details["fields"]) == (
        grpc.StatusCode.FAILED_PRECONDITION, "LORA_DISABLED", ["lora_name"])
    details = _refusal(lambda: LoraAdapters(channel, timeout=TIMEOUT).load("a", "a"))
    assert details["reason"] == "LORA_DISABLED"


# ---------------------------------------------------------------------------- through the gateway


def test_the_openai_sdk_selects_an_adapter_by_model_through_the_three_services(qwen2, front, tiny_text_model):
    """render -> engine -> derender behind the gateway: `model` names the adapter, /v1/models lists
    it with its parent, and the reply is HF + PEFT's greedy tokens for the rendered chat."""
    import openai
    from transformers import AutoTokenizer

    model = str(tiny_text_model)
    client = openai.OpenAI(base_url=front.gateway(qwen2.address, allow_runtime_lora_updating=True),
                           api_key="unused", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", *NAMES} and cards["mlp-r16"].model_extra["parent"] == "tiny"

    messages = [{"role": "user", "content": "Say hello"}]
    prompt = front.prompt("Say hello")
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = {}
    for name in ("tiny", "mlp-r16"):
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
        assert reply.model == name
        expected = qwen2.reference.generate(None if name == "tiny" else name, prompt, 6)
        assert reply.usage.completion_tokens == len(expected)
        texts[name] = reply.choices[0].message.content
        assert texts[name] == tokenizer.decode(expected, skip_special_tokens=True)
    assert texts["tiny"] != texts["mlp-r16"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=messages, max_tokens=2)

    # vLLM's loading endpoints (--allow-runtime-lora-updating): loaded on the engine, usable at once.
    make_adapter(tiny_text_model, AdapterSpec("late", 8, ("o_proj",), seed=9), qwen2.root / "late")
    loaded = client.post("/load_lora_adapter", body={"lora_name": "late", "lora_path": "late"}, cast_to=str)
    assert loaded == "Success: LoRA adapter 'late' added successfully."
    reply = client.chat.completions.create(model="late", messages=messages, max_tokens=6, temperature=0)
    assert reply.usage.completion_tokens > 0 and "late" in {card.id for card in client.models.list().data}
    client.post("/unload_lora_adapter", body={"lora_name": "late"}, cast_to=str)
    assert "late" not in [adapter.name for adapter in qwen2.adapters.list()]


def test_the_gateway_loads_an_adapter_of_its_lora_modules_a_chat_names(qwen2, front, tiny_text_model):
    """--lora-modules: /v1/models lists the adapter before any engine holds it; the first chat
    naming it makes the gateway's router load it on the engine, and its reply is HF + PEFT's."""
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=front.gateway(qwen2.address, lora_modules=("on-demand=attn-r8",)),
                           api_key="unused", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert cards["on-demand"].model_extra["root"] == "attn-r8" and "on-demand" not in {
        adapter.name for adapter in qwen2.adapters.list()}
    reply = client.chat.completions.create(model="on-demand", messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=6, temperature=0)
    expected = qwen2.reference.generate("attn-r8", front.prompt("Say hi"), 6)
    assert reply.choices[0].message.content == AutoTokenizer.from_pretrained(tiny_text_model).decode(
        expected, skip_special_tokens=True)
    held = {adapter.name: adapter.path for adapter in qwen2.adapters.list()}
    assert held["on-demand"] == "attn-r8"
    qwen2.adapters.unload("on-demand")


def test_chats_over_four_adapters_while_two_come_and_go_equal_their_solo_runs(aio_server, tiny_text_model,
                                                                               tmp_path):
    """64 chats over four adapters, two of them unloaded and loaded again over and over meanwhile
    (so they trade slots under running requests): each chat finishes with its solo run's tokens,
    or (its adapter away when it arrived) is refused NOT_FOUND; the engine serves on."""
    names = ["w", "x", "y", "z"]
    for index, name in enumerate(names):
        make_adapter(tiny_text_model, AdapterSpec(name, 8, ("q_proj", "up_proj"), seed=30 + index), tmp_path / name)
    stub, channel = _serve(aio_server, tiny_text_model, tmp_path, max_loras=4,
                           lora_modules=tuple(f"{name}={name}" for name in names))
    adapters = LoraAdapters(channel, timeout=TIMEOUT)
    prompts = [_prompt(200 + index, 5 + index) for index in range(8)]
    solo = {(name, index): _generate(stub, prompt, name)[0] for name in names for index, prompt in enumerate(prompts)}
    outcomes: list[str] = []
    stop = threading.Event()
    churned = ("y", "z")
    cycles = {name: 0 for name in churned}

    def churn(name: str) -> None:  # `name` comes and goes while the chats run
        while not stop.is_set():
            adapters.unload(name)
            while True:  # back as soon as the requests still using it have finished
                try:
                    adapters.load(name, name)
                    cycles[name] += 1
                    break
                except grpc.RpcError as error:
                    assert error_details(error)["reason"] == "LORA_ADAPTER_EXISTS"
                    time.sleep(0.005)

    def chat(number: int) -> None:
        name, index = names[number % 4], (number // 4) % len(prompts)
        time.sleep(0.002 * number)
        try:
            tokens, _ = _generate(stub, prompts[index], name)
        except grpc.RpcError as error:
            assert name in churned and error_details(error)["reason"] == "LORA_ADAPTER_NOT_FOUND", (name, error)
            outcomes.append("refused")
            return
        assert tokens == solo[(name, index)], (name, index)
        outcomes.append("equal")

    churners = [threading.Thread(target=churn, args=(name,)) for name in churned]
    for churner in churners:
        churner.start()
    chats = [threading.Thread(target=chat, args=(number,)) for number in range(64)]
    for thread in chats:
        thread.start()
    for thread in chats:
        thread.join(TIMEOUT)
    stop.set()
    for churner in churners:
        churner.join(TIMEOUT)
    assert len(outcomes) == 64 and outcomes.count("equal") >= 32, outcomes
    assert min(cycles.values()) >= 1, cycles  # both came and went while the chats ran
    assert sorted(adapter.name for adapter in adapters.list()) == names
