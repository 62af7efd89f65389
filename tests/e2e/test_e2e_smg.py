"""End to end: the real SMG gateway (`smg launch --backend vllm`, PyPI smg) in front of a tito engine
process, which it drives over SMG's vllm.grpc.engine.VllmEngine, and the official `openai` SDK
against SMG, on each engine backend (native, and vllm: `tito serve engine --backend vllm`) over the
same checkpoint (tiny-qwen2-d64: vLLM's CPU attention refuses head_dim 16): chat whole and streamed,
completions with the engine's own tokens, stop strings (an answer one ended still reports the
prompt's cached tokens), seed, n, logprobs, json_schema, a Responses call; SMG's own reasoning and
tool-call parsers read the engine's tokens (a `<think>` block and a `get_weather` call, the engine
constrained to them by a regex: a random model writes neither); a client that drops its stream frees
the engine's slot; with the parser flags `tito serve all --smg-address` gives it, SMG splits
`<think>` reasoning as tito's own qwen3 parser does. Over tito-demo (native only: its head_dim 16
keeps it off vLLM's CPU attention) the parsers read what the model itself answers. The same 32
greedy chats answer alike through SMG -> each backend, through tito's own gateway -> render ->
engine -> derender, and through SMG -> `vllm serve --grpc` (vLLM with SMG's own servicer,
smg-grpc-servicer) on the same checkpoint. An image chat on tiny-qwen2-vl-smg (the Qwen2-VL
checkpoint shape SMG's own image preprocessing accepts) answers as tito's own pipeline does."""

from __future__ import annotations

import json
import re
import time

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from tito.v1 import engine_pb2_grpc

from engine_calls import collect, request
from service_processes import running_gateway, running_render_and_derender, running_smg, running_tcp_engine
from vllm_serve import TITO_VLLM_BACKEND_ARGS, running_vllm_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.smg]

CONTEXT = 512
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def text_model(tiny_text_model_d64):
    """The checkpoint every path here serves."""
    return tiny_text_model_d64


@pytest.fixture(scope="module")
def native_engine(text_model, tmp_path_factory):
    with running_tcp_engine(text_model, tmp_path_factory.mktemp("engine"),
                            ["--max-model-len", str(CONTEXT)]) as address:
        yield address


@pytest.fixture(scope="module")
def vllm_engine(text_model, tmp_path_factory):
    with running_tcp_engine(text_model, tmp_path_factory.mktemp("vllm-engine"),
                            ["--max-model-len", str(CONTEXT), *TITO_VLLM_BACKEND_ARGS]) as address:
        yield address


@pytest.fixture(scope="module", params=["native", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine_address(request):
    """The engine SMG drives, once per backend (pytest runs each backend's tests together)."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def smg(engine_address, text_model, tmp_path_factory):
    # The tiny model's name says "qwen", for which SMG would run its thinking parser and report the
    # whole answer as reasoning: passthrough keeps the text as the engine made it.
    with running_smg([engine_address], str(text_model), tmp_path_factory.mktemp("smg"),
                     ["--reasoning-parser", "passthrough"]) as running:
        yield running.base


@pytest.fixture(scope="module")
def client(smg):
    with openai.OpenAI(base_url=f"{smg}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(text_model) -> str:
    return str(text_model)


@pytest.fixture(scope="module")
def tokenizer(text_model):
    return AutoTokenizer.from_pretrained(str(text_model))


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _loads(engine_address) -> vllm_engine_pb2.SchedulerLoad:
    with grpc.insecure_channel(engine_address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        return stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=30).loads[0]


def test_completions_are_the_engines_own_greedy_tokens(client, model, engine_address, tokenizer):
    prompt = "hello world, this is a test"
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=16, **GREEDY)
    ids = tokenizer(prompt)["input_ids"]
    with grpc.insecure_channel(engine_address) as channel:
        tokens, _ = collect(engine_pb2_grpc.EngineServiceStub(channel).Generate(request(ids, max_tokens=16),
                                                                                timeout=60))
    assert answer.choices[0].text == tokenizer.decode(tokens[0], skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(tokens[0])


def test_chat_whole_and_streamed_say_the_same(client, model):
    whole = client.chat.completions.create(model=model, messages=_chat("hi"), max_tokens=24, **GREEDY)
    stream = client.chat.completions.create(model=model, messages=_chat("hi"), max_tokens=24, stream=True, **GREEDY)
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert whole.choices[0].message.content and "".join(pieces) == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == finish
    assert whole.usage.completion_tokens <= 24


def _stop_in(text: str) -> str:
    """Three characters from the middle of `text` that occur there first."""
    return next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)


def test_a_stop_string_ends_the_answer(client, model):
    text = client.completions.create(model=model, prompt="one two three", max_tokens=24, **GREEDY).choices[0].text
    stop = _stop_in(text)
    answer = client.completions.create(model=model, prompt="one two three", max_tokens=24, stop=[stop], **GREEDY)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == text[:text.index(stop)]


def test_an_answer_a_stop_string_ended_reports_the_prompts_cached_tokens(client, model):
    # A prompt longer than a block of either backend (vLLM's CPU blocks hold 128 tokens), asked
    # twice: the second time its whole blocks are cached.
    messages = [{"role": "system", "content": SYSTEMS[0] * 4}, {"role": "user", "content": "Tell me one fact."}]
    again = [client.chat.completions.create(model=model, messages=messages, max_tokens=24, **GREEDY)
             for _ in range(2)][1]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                             stop=[_stop_in(again.choices[0].message.content)], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.prompt_tokens_details.cached_tokens == cached


def test_seed_n_and_logprobs(client, model):
    def sampled(seed):
        return client.chat.completions.create(model=model, messages=_chat("tell me"), max_tokens=16, temperature=1.0,
                                              seed=seed, n=2, logprobs=True, top_logprobs=2)
    first, again, other = sampled(11), sampled(11), sampled(12)
    contents = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1]
    assert contents == [choice.message.content for choice in again.choices]
    assert contents != [choice.message.content for choice in other.choices]
    for choice in first.choices:
        entries = choice.logprobs.content
        assert entries and all(len(entry.top_logprobs) == 2 for entry in entries)
        assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in entries)


def test_json_schema_constrains_the_answer(client, model):
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = client.chat.completions.create(
        model=model, messages=_chat("yes or no?"), max_tokens=16, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(answer.choices[0].message.content) in ("yes", "no")
    assert answer.choices[0].finish_reason == "stop"


#: 32 chats, each answered greedily in up to 24 tokens on every path.
GREEDY_CHATS = ["hi", "tell me about Paris", "one two three", "what is the weather like?", "count to five",
                "write a short poem", "def add(a, b):", "Hello! What can you do?", "The quick brown fox",
                "Once upon a time", "What time is it?", "Name a colour.", "Think step by step.",
                "Please answer the question below.", "How are you today?", "Tell me a story about a cat.",
                "What is two plus two?", "Translate hello into French.", "Give me a list of three fruits.",
                "Why is the sky blue?", "Summarise this: the sun was shining.", "Write JSON with a name field.",
                "Who are you?", "What can you do?", "Explain a journey of a thousand miles.",
                "Describe the harbour in the morning.", "class Counter:", "print('hello')",
                "Is it raining in Tokyo?", "What is the capital of France?", "Say something nice.",
                "The end."]


def _greedy_answers(sdk, model: str) -> list:
    return [sdk.chat.completions.create(model=model, messages=_chat(text), max_tokens=24, **GREEDY)
            for text in GREEDY_CHATS]


@pytest.fixture(scope="module")
def smg_answers(client, model):
    """The greedy chats through SMG -> the engine (per backend)."""
    return _greedy_answers(client, model)


@pytest.fixture(scope="module")
def tito_answers(native_engine, text_model, tmp_path_factory):
    """The greedy chats through tito's own gateway, render and derender over the native engine."""
    with running_render_and_derender(text_model, tmp_path_factory.mktemp("front"), native_engine) as addresses:
        with running_gateway(addresses, ["--served-model-name", str(text_model)]) as (base, _):
            with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
                return _greedy_answers(sdk, str(text_model))


@pytest.fixture(scope="module")
def vllm_grpc_answers(text_model, tmp_path_factory):
    """The greedy chats through SMG -> `vllm serve --grpc` (vLLM's engine behind SMG's own servicer);
    the vLLM server stops once they are answered."""
    directory = tmp_path_factory.mktemp("vllm-grpc")
    with running_vllm_grpc(text_model, directory) as address:
        with running_smg([address], str(text_model), directory, ["--reasoning-parser", "passthrough"]) as running:
            with openai.OpenAI(base_url=f"{running.base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
                return _greedy_answers(sdk, str(text_model))


def _assert_answer_alike(ours: list, theirs: list) -> None:
    for text, our_answer, their_answer in zip(GREEDY_CHATS, ours, theirs, strict=True):
        our_choice, their_choice = our_answer.choices[0], their_answer.choices[0]
        # An answer cut by max_tokens inside a multi-byte character: tito's derender ends it with
        # U+FFFD for the dangling bytes, SMG's detokenizer drops them. The tokens are the same.
        assert our_choice.message.content.rstrip("\ufffd") == their_choice.message.content.rstrip("\ufffd"), text
        assert our_choice.finish_reason == their_choice.finish_reason, text
        # The same prompt (all render with the model's chat template) and the same number of tokens.
        assert (our_answer.usage.prompt_tokens, our_answer.usage.completion_tokens) == \
            (their_answer.usage.prompt_tokens, their_answer.usage.completion_tokens), text
    assert len({answer.choices[0].message.content for answer in ours}) > 1  # not one canned answer


def test_greedy_chats_answer_alike_through_smg_and_through_titos_gateway(smg_answers, tito_answers):
    _assert_answer_alike(smg_answers, tito_answers)


@pytest.mark.vllm
def test_greedy_chats_answer_alike_through_smg_over_tito_and_over_vllm_serve_grpc(smg_answers, vllm_grpc_answers):
    _assert_answer_alike(smg_answers, vllm_grpc_answers)


def test_a_dropped_stream_frees_the_engines_slot(client, model, engine_address):
    stream = client.chat.completions.create(model=model, messages=_chat("go on"), max_tokens=CONTEXT - 64,
                                            stream=True, extra_body={"ignore_eos": True}, **GREEDY)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    assert _loads(engine_address).num_running_reqs == 1
    stream.close()
    deadline = time.monotonic() + 15
    while _loads(engine_address).num_running_reqs and time.monotonic() < deadline:
        time.sleep(0.05)
    load = _loads(engine_address)
    assert load.num_running_reqs == load.num_waiting_reqs == 0


#: Per conversation, a system prompt of its own: long enough for several 16-token blocks that no
#: other conversation shares, so only the engine that served a conversation holds its prefix.
SYSTEMS = [f"You answer questions about {topic} in two short sentences, naming {topic} each time. " * 3
           for topic in ("rivers", "mountains", "deserts", "islands")]
LATER_TURNS = len(SYSTEMS) * 2


def _event_hits(metrics_url: str) -> float:
    """SMG's count of cache-aware picks made from its KV-event index (the engines' events)."""
    import httpx

    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("smg_cache_aware_policy_branch_total") and 'branch="event_hit"' in line)


def test_smgs_cache_aware_policy_follows_the_engines_kv_events(native_engine, text_model, model, tmp_path_factory):
    """Two engines behind SMG's cache_aware: every later turn of a chat goes to the engine whose
    SubscribeKvEvents reported its prefix, and finds it there."""
    import httpx

    directory = tmp_path_factory.mktemp("cache-aware")
    with running_tcp_engine(text_model, directory, ["--max-model-len", str(CONTEXT)]) as second, \
            running_smg([native_engine, second], model, directory,
                        ["--policy", "cache_aware", "--reasoning-parser", "passthrough"]) as running:
        for address in (native_engine, second):  # what earlier tests left must not count
            with grpc.insecure_channel(address) as channel:
                vllm_engine_pb2_grpc.VllmEngineStub(channel).FlushCache(common_pb2.FlushCacheRequest(), timeout=30)
        hits_before = _event_hits(running.metrics)
        for system in SYSTEMS:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me one fact."}]
            first_engine, previous_prompt = None, 0
            for turn in range(3):
                if turn:
                    messages += [{"role": "assistant", "content": "Here is one fact."},
                                 {"role": "user", "content": f"And another one, number {turn}?"}]
                reply = httpx.post(f"{running.base}/v1/chat/completions", timeout=60, json={
                    "model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
                assert reply.status_code == 200, reply.text
                engine, usage = reply.headers["x-smg-routed-worker-id"], reply.json()["usage"]
                if turn:
                    assert engine == first_engine, (system, turn)
                    # At least every whole 16-token block of the previous turn's prompt was a hit.
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= previous_prompt // 16 * 16 - 16
                first_engine, previous_prompt = first_engine or engine, usage["prompt_tokens"]
        time.sleep(0.1)
        assert _event_hits(running.metrics) - hits_before >= LATER_TURNS  # picked by the events, not by chance


@pytest.fixture(scope="module")
def parsing_client(engine_address, model, tmp_path_factory):
    """SMG with its own Qwen reasoning and tool-call parsers over the engine (per backend)."""
    with running_smg([engine_address], model, tmp_path_factory.mktemp("parsing-smg"),
                     ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen"]) as running:
        with openai.OpenAI(base_url=f"{running.base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
            yield sdk


#: A few lowercase words: what the constrained answers below are made of.
WORDS = r"[a-z]{1,6}( [a-z]{1,6}){1,3}"


def test_smgs_reasoning_parser_reads_a_think_block_the_engine_wrote(parsing_client, model):
    answer = parsing_client.chat.completions.create(
        model=model, messages=_chat("Think, then answer."), max_tokens=160, **GREEDY,
        extra_body={"regex": f"<think>\n{WORDS}\n</think>\n\n{WORDS}"})
    message = answer.choices[0].message
    assert re.fullmatch(WORDS, message.reasoning_content.strip()), message
    assert re.fullmatch(WORDS, message.content.strip()), message
    assert answer.choices[0].finish_reason == "stop"


def test_smgs_tool_parser_reads_a_call_the_engine_wrote(parsing_client, model):
    from tito_models import demo

    call_text = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,6}"\}\}\n</tool_call>'
    answer = parsing_client.chat.completions.create(
        model=model, messages=_chat("What is the weather in Lima?"), tools=[demo.WEATHER_TOOL], max_tokens=160,
        # A think block first, as tito-demo writes: SMG's qwen3 parser takes an answer without one
        # for reasoning.
        **GREEDY, extra_body={"regex": f"<think>\n{WORDS}\n</think>\n\n{call_text}"})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and list(arguments) == ["city"]
    assert re.fullmatch("[A-Z][a-z]{1,6}", arguments["city"])


@pytest.fixture(scope="module")
def tito_parsers_client(engine_address, model, tmp_path_factory):
    """SMG with the parser flags `tito serve all --smg-address` gives it for a qwen3-reasoning model
    that writes no tool calls (per backend)."""
    from tito_cli.smg import parser_flags

    with running_smg([engine_address], model, tmp_path_factory.mktemp("tito-parsers-smg"),
                     parser_flags("qwen3", "")) as running:
        with openai.OpenAI(base_url=f"{running.base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
            yield sdk


def _split_by_titos_qwen3(text: str) -> tuple[str, str]:
    """(reasoning, content) of `text` as tito's derender splits it with its qwen3 parser."""
    from tito_derender.domain import OutputDelta
    from tito_derender.parsers import REASONING_PARSERS

    split = REASONING_PARSERS["qwen3"](False, None).process(OutputDelta(content=text), final=True)
    return split.reasoning_content, split.content


def _split_through(sdk, model: str, regex: str, stream: bool) -> tuple[str, str]:
    """(reasoning, content) of SMG's answer to a chat constrained to `regex`, whole or streamed."""
    asked = {"model": model, "messages": _chat("Think, then answer."), "max_tokens": 160,
             "extra_body": {"regex": regex}, **GREEDY}
    if not stream:
        message = sdk.chat.completions.create(**asked).choices[0].message
        return message.reasoning_content or "", message.content or ""
    reasoning, content = [], []
    for chunk in sdk.chat.completions.create(stream=True, **asked):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("regex", [WORDS, f"<think>\n{WORDS}\n</think>\n\n{WORDS}", f"{WORDS}\n</think>\n\n{WORDS}"],
                         ids=["no think block", "think block", "a closing tag only"])
def test_smg_with_titos_parser_flags_splits_reasoning_as_titos_derender(tito_parsers_client, client, model, regex):
    """A think-less answer is content (SMG's legacy qwen3 would file it as reasoning), a think block
    is reasoning, whole and streamed, exactly as tito's own qwen3 parser splits the same text."""
    raw = client.chat.completions.create(model=model, messages=_chat("Think, then answer."), max_tokens=160,
                                         extra_body={"regex": regex}, **GREEDY).choices[0].message.content
    expected = _split_by_titos_qwen3(raw)
    for stream in (False, True):
        assert _split_through(tito_parsers_client, model, regex, stream) == expected, (raw, stream)
    assert expected[1]  # each case has content


def test_a_responses_call_answers_as_the_chat_does(client, model):
    chat = client.chat.completions.create(model=model, messages=_chat("Hello! What can you do?"), max_tokens=24,
                                          **GREEDY)
    answer = client.responses.create(model=model, input="Hello! What can you do?", max_output_tokens=24,
                                     temperature=0)
    assert answer.output_text and answer.output_text == chat.choices[0].message.content


@pytest.fixture(scope="module")
def demo_client(demo_model, tmp_path_factory):
    """SMG with its own Qwen parsers, as tito names them for tito-demo (qwen3 reasoning, hermes
    calls), over a tito engine serving tito-demo (thinks, calls get_weather)."""
    from tito_cli.smg import parser_flags

    with running_tcp_engine(demo_model, tmp_path_factory.mktemp("demo-engine")) as address:
        with running_smg([address], str(demo_model), tmp_path_factory.mktemp("demo-smg"),
                         parser_flags("qwen3", "hermes")) as running:
            with openai.OpenAI(base_url=f"{running.base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
                yield sdk, str(demo_model)


def test_smgs_reasoning_and_tool_parsers_read_the_engines_tokens(demo_client):
    from tito_models import demo

    client, model = demo_client
    greeting = client.chat.completions.create(model=model, messages=_chat("Hello! What can you do?"),
                                              max_tokens=80, **GREEDY)
    message = greeting.choices[0].message
    assert message.content.strip() == demo.GREETING_ANSWER
    assert message.reasoning_content.strip() == "The user says hello. I will say what I can do."
    weather = client.chat.completions.create(model=model, messages=_chat("What is the weather in Tokyo?"),
                                             tools=[demo.WEATHER_TOOL], max_tokens=80, **GREEDY)
    choice = weather.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}


def test_an_answer_with_thinking_off_is_content_through_smgs_legacy_qwen3(demo_client):
    """What tito's parsers for tito-demo (qwen3 with hermes calls: SMG's legacy qwen3, since its
    Symphony table reads no hermes calls) do with a think-less answer: content, as through tito's
    gateway, where the request turns thinking off (the template then closes the block itself)."""
    from tito_models import demo

    client, model = demo_client
    message = client.chat.completions.create(
        model=model, messages=_chat("Hello! What can you do?"), max_tokens=80, **GREEDY,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content.strip() == demo.GREETING_ANSWER and not message.reasoning_content


def test_the_responses_api_through_smg(demo_client):
    from tito_models import demo

    client, model = demo_client
    answer = client.responses.create(model=model, input="Hello! What can you do?", max_output_tokens=80,
                                     temperature=0)
    assert answer.output_text.strip() == demo.GREETING_ANSWER


@pytest.fixture(scope="module")
def image_clients(tiny_smg_vl_model, tmp_path_factory):
    """SMG (preprocessing the images itself: --mm-processing router) and tito's own gateway, render
    and derender, both over one native engine serving tiny-qwen2-vl-smg (the tiny Qwen2-VL with the
    image token SMG's Qwen2-VL preprocessing expects)."""
    model = str(tiny_smg_vl_model)
    directory = tmp_path_factory.mktemp("smg-vl")
    with running_tcp_engine(model, directory) as engine, \
            running_smg([engine], model, directory, ["--reasoning-parser", "passthrough", "--mm-processing", "router",
                                                     "--multimodal-tensor-transport", "inline"]) as smg_running, \
            running_render_and_derender(model, directory, engine) as addresses, \
            running_gateway(addresses, ["--served-model-name", model]) as (tito_base, _):
        with openai.OpenAI(base_url=f"{smg_running.base}/v1", api_key="none", max_retries=0, timeout=120) as smg_sdk, \
                openai.OpenAI(base_url=f"{tito_base}/v1", api_key="none", max_retries=0, timeout=120) as tito_sdk:
            yield smg_sdk, tito_sdk, model


def test_an_image_chat_through_smg_answers_as_titos_pipeline(image_clients):
    from images import noise_data_url

    smg_sdk, tito_sdk, model = image_clients
    answers = []
    # Sides that are multiples of 28 (patch 14 x merge 2): no resize, so SMG's preprocessing and
    # render's give the same pixels; two images of different sizes, different spans.
    for width, height, seed in ((56, 84, 1), (112, 56, 2)):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": noise_data_url(width, height, seed=seed)}},
            {"type": "text", "text": "What is in this picture?"}]}]
        through_smg, through_tito = (sdk.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                                                 **GREEDY) for sdk in (smg_sdk, tito_sdk))
        # The same prompt: the template's anchor expanded to as many image tokens on both paths.
        assert through_smg.usage.prompt_tokens == through_tito.usage.prompt_tokens
        assert through_smg.usage.completion_tokens == through_tito.usage.completion_tokens
        assert through_smg.choices[0].message.content.rstrip("\ufffd") == \
            through_tito.choices[0].message.content.rstrip("\ufffd")
        answers.append(through_smg.choices[0].message.content)
    assert answers[0] != answers[1]  # the image, not the text alone, decides the answer
