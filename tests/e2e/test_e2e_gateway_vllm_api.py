"""End to end: vLLM's token-in/token-out HTTP API on `tito serve gateway` over the three services
as processes (the demo model). Render endpoint -> generate endpoint -> derender endpoint gives
the text /v1/chat/completions gives for the same greedy chat, and so do the render endpoint's ids
forwarded to the chat (`kv_transfer_params.prompt_token_ids`); an RL-style loop (64 prompts x 4 seeds) gets logprobs and
reproduces its samples by seed in any batch; an abort ends a running generate; the real services' refusals
arrive as vLLM's error JSON naming the field; AIPerf's `vllm_generate` (tito's endpoint plugin)
benchmarks the generate endpoint to completion with exact token counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tokenizers import Tokenizer
import pytest

from images import noise_data_url
from service_processes import running_gateway, running_services
from tito_gateway.vllm_api import mm_serde

pytestmark = pytest.mark.e2e

MODEL = "tito-demo"
GREETING = [{"role": "user", "content": "Hello! What can you do?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def base(demo_model, tmp_path_factory):
    with running_services(demo_model, tmp_path_factory.mktemp("sockets")) as (addresses, _):
        with running_gateway(addresses, ["--served-model-name", MODEL]) as (url, _process):
            yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


def _ok(reply: httpx.Response):
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_render_generate_derender_gives_the_chats_text(http):
    chat = {"model": MODEL, "messages": GREETING, "max_tokens": 48, "temperature": 0, **NO_THINKING}
    direct = _ok(http.post("/v1/chat/completions", json=chat))
    rendered = _ok(http.post("/v1/chat/completions/render", json=chat))
    generated = _ok(http.post("/inference/v1/generate", json=rendered))
    derendered = _ok(http.post("/v1/chat/completions/derender", json={
        "generate_response": generated, "prompt_token_ids": rendered["token_ids"],
        "prompt_tokens": len(rendered["token_ids"]), "chat_request": chat}))
    assert derendered["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert derendered["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert derendered["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert derendered["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]

    streamed = http.post("/inference/v1/generate", json={**rendered, "stream": True})
    tokens = [token for line in streamed.text.split("\n\n") if line.startswith("data: {")
              for choice in json.loads(line[6:])["choices"] for token in choice["token_ids"]]
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert tokens == generated["choices"][0]["token_ids"]


def test_forwarded_prompt_ids_give_the_chats_text(http):
    chat = {"model": MODEL, "messages": GREETING, "max_tokens": 48, "temperature": 0, **NO_THINKING}
    direct = _ok(http.post("/v1/chat/completions", json=chat))
    rendered = _ok(http.post("/v1/chat/completions/render", json=chat))
    reused = _ok(http.post("/v1/chat/completions", json={
        **chat, "kv_transfer_params": {"prompt_token_ids": rendered["token_ids"]}}))
    assert reused["choices"][0]["message"] == direct["choices"][0]["message"]
    assert reused["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def test_completion_render_generate_derender_gives_the_completions_text(http):
    body = {"model": MODEL, "prompt": "Hello! What", "max_tokens": 12, "temperature": 0}
    direct = _ok(http.post("/v1/completions", json=body))
    (rendered,) = _ok(http.post("/v1/completions/render", json=body))
    generated = _ok(http.post("/inference/v1/generate", json=rendered))
    derendered = _ok(http.post("/v1/completions/derender", json={
        "generate_responses": [generated], "prompt_token_ids": [rendered["token_ids"]],
        "prompt_tokens": [len(rendered["token_ids"])], "completion_request": body}))
    assert derendered["choices"][0]["text"] == direct["choices"][0]["text"]


def test_rl_loop_gets_logprobs_and_reproduces_by_seed(http):
    """The issue's rollout shape: 64 prompts x 4 seeded samples, 8 in flight at once as a trainer's
    workers send them; every sample replayed alone gives the same tokens."""
    topics = ("Paris", "Tokyo", "Lima", "rivers", "bread", "chess", "the moon", "rain")
    with ThreadPoolExecutor(8) as pool:
        prompts = list(pool.map(lambda index: _ok(http.post("/v1/chat/completions/render", json={
            "model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {topics[index % 8]}, part "
                                          f"{index // 8}."}], **NO_THINKING}))["token_ids"], range(64)))

        def sample(key: tuple[int, int]) -> dict:
            prompt, seed = key
            return _ok(http.post("/inference/v1/generate", json={
                "token_ids": prompts[prompt], "sampling_params": {"temperature": 4.0, "seed": seed, "max_tokens": 8,
                                                                  "logprobs": 0, "ignore_eos": True}}))["choices"][0]

        keys = [(prompt, seed) for prompt in range(64) for seed in (1, 2, 3, 4)]
        samples = dict(zip(keys, pool.map(sample, keys)))
        replays = dict(zip(keys[::-1], pool.map(sample, keys[::-1])))  # another order, other batch neighbours
    assert len({tuple(ids) for ids in prompts}) == 64
    for choice in samples.values():
        entries = choice["logprobs"]["content"]
        assert [entry["token_id"] for entry in entries] == choice["token_ids"] and len(entries) == 8
        assert all(entry["logprob"] <= 0.0 for entry in entries)
        assert all(entry["top_logprobs"][0]["token_id"] == entry["token_id"] for entry in entries)
    for key in keys:
        assert replays[key]["token_ids"] == samples[key]["token_ids"], key
    assert any(samples[(prompt, 1)]["token_ids"] != samples[(prompt, 2)]["token_ids"] for prompt in range(64))


def test_abort_ends_a_running_generate(http, base):
    body = {"request_id": "rl-abort-1", "token_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}
    finishes = []
    with httpx.Client(base_url=base, timeout=120) as other, other.stream("POST", "/inference/v1/generate",
                                                                          json=body) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["request_id"] == "generate-tokens-rl-abort-1"
        aborter = threading.Thread(target=lambda: http.post("/inference/v1/abort_requests",
                                                            json={"request_ids": ["rl-abort-1"]}))
        aborter.start()
        for line in lines:
            if line.startswith("data: {"):
                finishes += [choice["finish_reason"] for choice in json.loads(line[6:])["choices"]]
        aborter.join()
    assert finishes[-1] == "abort"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/inference/v1/generate", {"token_ids": [10**6], "sampling_params": {}}, "token_ids[0]"),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"temperature": -1}},
     "sampling_params.temperature"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%not-base64%%%"}}]}]},
     "messages[0].content"),  # render names the part
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {}, "content_parts": [
        {"type": "image_url", "url": "data:image/png;base64,%%%not-base64%%%"}]}, "content_parts[0]"),
])
def test_the_services_refusals_arrive_in_vllms_shape(http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["param"].startswith(param), error


# -- streamed derender: one call per generate chunk, tito's sealed stream_state carried between --

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
AGENT_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}
AGENT_TEXT = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def encode(demo_model):
    tokenizer = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def _chunks(ids: list[int], size: int) -> list[dict]:
    groups = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [{"request_id": "chatcmpl-s", "output_mode": "tokens", "usage": None, "choices": [{
        "index": 0, "token_ids": group, "finish_reason": "stop" if i == len(groups) - 1 else None,
        "stop_reason": None, "logprobs": None}]} for i, group in enumerate(groups)]


def _derender_stream(http, path: str, chunks: list[dict], first: dict) -> tuple[list[dict], list[str]]:
    """Derender `chunks` one call each, carrying stream_state; the chunks and the states."""
    answers, states, state = [], [], None
    for chunk in chunks:
        body = {"stream": True, "generate_chunk": chunk, "stream_state": state, **(first if state is None else {})}
        answer = _ok(http.post(path, json=body))
        answers.append(answer["chunk"])
        state = answer["stream_state"]
        states.append(state)
    return answers, states


def _assembled(choices: list[dict]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    content = "".join(c["delta"].get("content") or "" for c in choices)
    reasoning = "".join(c["delta"].get("reasoning") or "" for c in choices)
    calls: dict[int, list[str]] = {}
    for choice in choices:
        for call in choice["delta"].get("tool_calls") or []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    return content, reasoning, [tuple(v) for _, v in sorted(calls.items())], choices[-1]["finish_reason"]


@pytest.mark.parametrize("size", [1, 5])
def test_streamed_chat_derender_equals_whole_for_reasoning_and_tool_calls(http, encode, size):
    ids = encode(AGENT_TEXT)
    whole = _ok(http.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "chatcmpl-s", "choices": [{"index": 0, "token_ids": ids,
                                                                         "finish_reason": "stop"}]},
        "chat_request": AGENT_CHAT}))["choices"][0]
    answers, _ = _derender_stream(http, "/v1/chat/completions/derender", _chunks(ids, size),
                                  {"chat_request": AGENT_CHAT})
    content, reasoning, calls, finish = _assembled([a["choices"][0] for a in answers])
    message = whole["message"]
    assert reasoning == message["reasoning"] and "The user wants the weather." in reasoning
    assert content.strip() == (message["content"] or "").strip() == "Let me check."
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Paris"}
    assert finish == whole["finish_reason"] == "tool_calls"
    assert all(a["object"] == "chat.completion.chunk" and a["id"] == "chatcmpl-s" for a in answers)


def test_streamed_derender_of_a_real_generate_stream_equals_whole(http):
    chat = {"model": MODEL, "messages": GREETING, "max_tokens": 24, "temperature": 0, **NO_THINKING}
    rendered = _ok(http.post("/v1/chat/completions/render", json=chat))
    streamed = http.post("/inference/v1/generate", json={**rendered, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    ids = [t for chunk in chunks for choice in chunk["choices"] for t in choice["token_ids"]]
    whole = _ok(http.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "x", "choices": [{"index": 0, "token_ids": ids,
                                                              "finish_reason": "length"}]},
        "prompt_token_ids": rendered["token_ids"], "chat_request": chat}))
    answers, _ = _derender_stream(http, "/v1/chat/completions/derender", chunks,
                                  {"chat_request": chat, "prompt_token_ids": rendered["token_ids"]})
    content, _, _, finish = _assembled([choice for a in answers for choice in a["choices"]])
    assert content == whole["choices"][0]["message"]["content"] and finish == "length"
    completion = {"model": MODEL, "prompt": "Hello! What", "max_tokens": 12, "temperature": 0}
    direct = _ok(http.post("/v1/completions", json=completion))
    (prompt,) = _ok(http.post("/v1/completions/render", json=completion))
    generated = _ok(http.post("/inference/v1/generate", json=prompt))
    answers, _ = _derender_stream(http, "/v1/completions/derender",
                                  _chunks(generated["choices"][0]["token_ids"], 2),
                                  {"completion_request": completion, "prompt_token_ids": prompt["token_ids"]})
    assert "".join(a["choices"][0]["text"] for a in answers) == direct["choices"][0]["text"]


def test_the_stream_state_stays_bounded_and_is_checked(http, encode):
    ids = encode("<think>\nok\n</think>\n\n" + "The colour of the sky is blue today. " * 30)
    assert len(ids) > 150
    _, states = _derender_stream(http, "/v1/chat/completions/derender", _chunks(ids, 1), {"chat_request": AGENT_CHAT})
    assert max(len(s) for s in states[-50:]) <= len(states[30]) + 32, (len(states[30]), max(map(len, states[-50:])))
    state = states[-2]
    changed = state[:10] + ("A" if state[10] != "A" else "B") + state[11:]
    last = _chunks(ids, 1)[-1]
    for bad in (changed, "A" * 100_000, {"output_token_ids": [1]}):
        reply = http.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": last,
                                                                 "stream_state": bad})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "stream_state"


# -- media on the tiny Qwen2-VL: content_parts, hashes-only features, vLLM's serialized tensors --

def _image_chat(url: str) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": MODEL, "max_tokens": 12, "temperature": 0, **NO_THINKING,
            "messages": [{"role": "user", "content": content}]}


def _greedy_tokens(http, body: dict) -> list[int]:
    return _ok(http.post("/inference/v1/generate", json=body))["choices"][0]["token_ids"]


def _collapsed(ids: list[int], start: int, length: int) -> list[int]:
    """`ids` with the span at `start` back to its one-token marker, as the chat template writes it."""
    return ids[:start + 1] + ids[start + length:]


def test_media_generate_by_content_parts_features_and_serialized_tensors_gives_the_chats_tokens(http):
    url = noise_data_url(84, 56, seed=11)
    chat = _image_chat(url)
    rendered = _ok(http.post("/v1/chat/completions/render", json={**chat, "mm_payload": "none"}))
    (place,) = rendered["features"]["mm_placeholders"]["image"]
    sampling = {"max_tokens": 12, "temperature": 0}
    parts = [{"type": "image_url", "url": url}]
    by_parts = _greedy_tokens(http, {"token_ids": rendered["token_ids"], "content_parts": parts,
                                     "sampling_params": sampling})
    derendered = _ok(http.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "x", "choices": [{"index": 0, "token_ids": by_parts,
                                                              "finish_reason": "length"}]},
        "prompt_token_ids": rendered["token_ids"], "chat_request": chat}))
    direct = _ok(http.post("/v1/chat/completions", json=chat))
    assert derendered["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    marker = _collapsed(rendered["token_ids"], place["offset"], place["length"])
    assert _greedy_tokens(http, {"token_ids": marker, "content_parts": parts, "sampling_params": sampling}) == by_parts
    # The engine holds the image now: hashes and placeholders only (tito's METADATA path).
    assert _greedy_tokens(http, {**rendered, "sampling_params": sampling}) == by_parts

    reused = _ok(http.post("/v1/chat/completions", json={**chat, "kv_transfer_params": {
        "prompt_token_ids": rendered["token_ids"], "prompt_features": rendered["features"]}}))
    assert reused["choices"][0]["message"] == direct["choices"][0]["message"]

    if not mm_serde.available():
        return
    # An image the engine has not seen: without its tensors (read from kwargs_data) it would refuse it.
    other = noise_data_url(56, 84, seed=12)
    with_tensors = _ok(http.post("/v1/chat/completions/render", json=_image_chat(other)))
    assert with_tensors["features"]["kwargs_data"]["image"][0]
    assert with_tensors["features"]["mm_hashes"] != rendered["features"]["mm_hashes"]
    from_tensors = _greedy_tokens(http, {**with_tensors, "sampling_params": sampling})
    assert from_tensors == _greedy_tokens(http, {"token_ids": with_tensors["token_ids"], "sampling_params": sampling,
                                                 "content_parts": [{"type": "image_url", "url": other}]})


# -- AIPerf: `aiperf profile --endpoint-type vllm_generate` (tito_client.aiperf_plugin) --

AIPERF_TIMEOUT_S = 240  # its own start-up (a dozen processes) is most of it: about 20 s here
AIPERF_OUTPUT_TOKENS = 12


def test_aiperf_vllm_generate_runs_to_completion_with_exact_token_counts(base, demo_model, tmp_path):
    artifacts = tmp_path / "aiperf"
    tokenizer = str(demo_model)
    command = [str(Path(sys.executable).parent / "aiperf"), "profile", "--endpoint-type", "vllm_generate",
               "--url", base, "--model", MODEL, "--tokenizer", tokenizer, "--extra-inputs", f"tokenizer:{tokenizer}",
               "--streaming", "--request-count", "8", "--concurrency", "2", "--prompt-corpus", "random",
               "--synthetic-input-tokens-mean", "24", "--output-tokens-mean", str(AIPERF_OUTPUT_TOKENS),
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--ui-type", "none", "--artifact-dir", str(artifacts)]
    # AIPerf 0.13 offline (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to anything) loads tokenizers
    # from the hub's cache only, never from a directory.
    env = {name: value for name, value in os.environ.items() if name not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run = subprocess.run(command, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    sent = [json.loads(payload) if isinstance(payload, str) else payload
            for session in json.loads((artifacts / "inputs.json").read_text())["data"]
            for payload in session["payloads"]]
    assert len(sent) == 8
    assert all(body["sampling_params"] == {"max_tokens": AIPERF_OUTPUT_TOKENS, "ignore_eos": True} for body in sent)
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 8 and not any(record.get("error") for record in records), records
    metrics = [record["metrics"] for record in records]
    # Output counts are the ids received, which the server's usage confirms; the prompt's length
    # is that of one of the id lists the plugin sent.
    assert [m["output_sequence_length"]["value"] for m in metrics] == [AIPERF_OUTPUT_TOKENS] * 8
    assert [m["usage_completion_tokens"]["value"] for m in metrics] == [AIPERF_OUTPUT_TOKENS] * 8
    assert {m["input_sequence_length"]["value"] for m in metrics} <= {len(body["token_ids"]) for body in sent}
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 8 and summary["was_cancelled"] is False
    assert not summary.get("error_summary"), summary["error_summary"]
