"""End to end: vLLM's token-in/token-out HTTP API on `tito serve gateway` over the three services
as processes (the demo model). Render endpoint -> generate endpoint -> derender endpoint gives
the text /v1/chat/completions gives for the same greedy chat, and so do the render endpoint's ids
forwarded to the chat (`kv_transfer_params.prompt_token_ids`); an RL-style loop gets logprobs and
reproduces its samples by seed; an abort ends a running generate; the real services' refusals
arrive as vLLM's error JSON naming the field."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from service_processes import running_gateway, running_services

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
    prompts = [_ok(http.post("/v1/chat/completions/render", json={
        "model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {city}."}], **NO_THINKING}))
        ["token_ids"] for city in ("Paris", "Tokyo", "Lima")]

    def sample(ids: list[int], seed: int) -> dict:
        return _ok(http.post("/inference/v1/generate", json={
            "token_ids": ids, "sampling_params": {"temperature": 4.0, "seed": seed, "max_tokens": 8, "logprobs": 0,
                                                  "ignore_eos": True}}))["choices"][0]

    samples = {(p, seed): sample(ids, seed) for p, ids in enumerate(prompts) for seed in (1, 2)}
    for choice in samples.values():
        entries = choice["logprobs"]["content"]
        assert [entry["token_id"] for entry in entries] == choice["token_ids"] and len(entries) == 8
        assert all(entry["logprob"] <= 0.0 for entry in entries)
        assert all(entry["top_logprobs"][0]["token_id"] == entry["token_id"] for entry in entries)
    for (p, seed), choice in samples.items():
        assert sample(prompts[p], seed)["token_ids"] == choice["token_ids"]
    assert any(samples[(p, 1)]["token_ids"] != samples[(p, 2)]["token_ids"] for p in range(len(prompts)))


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
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%not-base64%%%"}}]}]}, None),
])
def test_the_services_refusals_arrive_in_vllms_shape(http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[0].content")  # render names the part
