"""vLLM's token-in/token-out API on the gateway, over a fake of the three services
(tests/support/gateway_fakes.py): render endpoints answer vLLM's GenerateRequest, generate takes
it (whole and streamed, logprobs, features) and derender turns the answer into OpenAI's; hostile
bodies are 4xx in vLLM's error shape naming the field. Where vLLM is installed its own pydantic
models check every answer's shape."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import grpc
import pytest
from gateway_fakes import ENGINE_ADDRESS, SERVED, VOCAB, FakeDerender, FakeRpcError, TokensUpstream
from starlette.testclient import TestClient

from tito.errors import InvalidArgument
from tito_gateway.app import Gateway

CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
def upstream() -> TokensUpstream:
    return TokensUpstream(model_id=SERVED)


@pytest.fixture
def client(upstream) -> Iterator[TestClient]:
    with TestClient(Gateway(upstream, max_body_bytes=64 * 1024).asgi(), raise_server_exceptions=False) as http:
        yield http


def _vllm_protocol():
    """vLLM's scale-out protocol module, or None where vLLM is not installed."""
    try:
        from vllm.entrypoints.scale_out.token_in_token_out import protocol
    except ImportError:
        return None
    return protocol


def _rendered(client, body=CHAT) -> dict:
    reply = client.post("/v1/chat/completions/render", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _generate(client, body: dict) -> dict:
    reply = client.post("/inference/v1/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _events(reply) -> list:
    lines = [line for line in reply.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_render_chat_answers_vllms_generate_request(client, upstream):
    rendered = _rendered(client, {**CHAT, "stop": ["END"], "seed": 5, "mm_payload": "none", "request_id": "r1"})
    assert rendered["request_id"] == "chatcmpl-r1"
    assert rendered["token_ids"] == [ord(c) % VOCAB for c in "user:Hello"]
    assert rendered["sampling_params"]["max_tokens"] == 3
    assert rendered["sampling_params"]["temperature"] == 0.0
    assert rendered["sampling_params"]["seed"] == 5
    assert rendered["sampling_params"]["stop"] == ["END"]
    assert rendered["output_mode"] == "tokens" and rendered["features"] is None
    assert upstream.pipeline.render.calls["RenderChat"] == 1
    protocol = _vllm_protocol()
    if protocol is not None:  # vLLM's own model takes it, field for field
        request = protocol.GenerateRequest.model_validate(rendered)
        assert request.sampling_params.max_tokens == 3 and request.sampling_params.stop == ["END"]
        assert set(rendered) == set(protocol.GenerateRequest.model_fields)


def test_render_messages_renders_the_chat_vllm_converts_it_to(client):
    messages = {"model": SERVED, "max_tokens": 3, "system": [{"type": "text", "text": "Be brief."},
                                                             {"type": "text", "text": "x-anthropic-billing-header: 1"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                             {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}],
                "stop_sequences": ["END"], "temperature": 0}
    chat = {"model": SERVED, "max_tokens": 3, "stop": ["END"], "temperature": 0, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]}
    ours = client.post("/v1/messages/render", json=messages)
    assert ours.status_code == 200, ours.text
    rendered = ours.json()
    assert rendered["token_ids"] == _rendered(client, chat)["token_ids"]
    assert rendered["sampling_params"]["stop"] == ["END"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "x": 1}]},
     "tools[0].x"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}},
     "tool_choice.type"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_reference", "tool_name": "t"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 2, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]},
     "messages[0].content[0].name"),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
     "thinking"),
])
def test_render_messages_refuses_what_it_does_not_map(client, body, param):
    reply = client.post("/v1/messages/render", json={"model": SERVED, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_render_responses_renders_the_chat_vllm_builds_for_it(client):
    body = {"model": SERVED, "max_output_tokens": 3, "instructions": "Be brief.", "request_id": "r9",
            "input": [{"type": "message", "role": "user", "content": "Hello"},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
                      {"role": "user", "content": "Bye"}]}
    chat = {"model": SERVED, "max_tokens": 3, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]}
    ours = client.post("/v1/responses/render", json=body)
    assert ours.status_code == 200, ours.text
    assert ours.json()["token_ids"] == _rendered(client, chat)["token_ids"]
    assert ours.json()["request_id"] == "resp_r9" and ours.json()["sampling_params"]["max_tokens"] == 3


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": [{"type": "function_call", "role": "assistant", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
])
def test_render_responses_refuses_what_it_does_not_map(client, body, param):
    reply = client.post("/v1/responses/render", json={"model": SERVED, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_render_completion_answers_one_request_per_prompt(client):
    reply = client.post("/v1/completions/render", json={"model": SERVED, "prompt": ["ab", [5, 6, 7]],
                                                        "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    first, second = reply.json()
    assert first["token_ids"] == [97, 98] and second["token_ids"] == [5, 6, 7]
    assert first["request_id"].endswith("-0") and second["request_id"].endswith("-1")


def test_rendered_request_generates_whole_with_logprobs(client, upstream):
    rendered = _rendered(client)
    rendered["sampling_params"]["logprobs"] = 2
    answer = _generate(client, rendered)
    last = rendered["token_ids"][-1]
    choice = answer["choices"][0]
    assert choice["token_ids"] == [(last + k + 1) % VOCAB for k in range(3)]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    entry = choice["logprobs"]["content"][0]
    assert entry["token_id"] == choice["token_ids"][0] and entry["logprob"] == -0.25 and entry["rank"] == 1
    assert [top["token_id"] for top in entry["top_logprobs"]] == [entry["token_id"], entry["token_id"] + 1]
    assert answer["usage"] == {"prompt_tokens": len(rendered["token_ids"]), "total_tokens":
                               len(rendered["token_ids"]) + 3, "completion_tokens": 3, "prompt_tokens_details": None}
    assert answer["request_id"] == "generate-tokens-" + rendered["request_id"]
    sent = upstream.pipeline.engine.requests[-1]
    assert list(sent.token_ids) == rendered["token_ids"] and sent.sampling_params.top_logprobs == 2
    protocol = _vllm_protocol()
    if protocol is not None:
        assert protocol.GenerateTokensResponse.model_validate(answer).choices[0].token_ids == choice["token_ids"]


def test_generate_streams_chunks_then_usage_then_done(client):
    body = {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2, "n": 2}, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with client.stream("POST", "/inference/v1/generate", json=body) as reply:
        reply.read()
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = _events(reply)
    *chunks, usage = events
    assert chunks[0]["prompt_token_ids"] == [10, 11]  # the first chunk only, as vLLM sends it
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    tokens = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        tokens[choice["index"]] += choice["token_ids"]
    assert tokens == {0: [12, 13], 1: [13, 14]}
    assert usage == {"request_id": chunks[0]["request_id"], "usage": {"prompt_tokens": 2, "total_tokens": 6,
                     "completion_tokens": 4}, "output_mode": "tokens", "choices": []}
    metrics = client.get("/metrics").text
    assert 'tito_gateway_requests_total{endpoint="generate",status="200"} 1.0' in metrics
    assert 'tito_gateway_time_to_first_token_seconds_count{endpoint="generate"} 1.0' in metrics
    protocol = _vllm_protocol()
    if protocol is not None:
        for event in events:
            protocol.GenerateTokensStreamResponse.model_validate(event)


def test_same_seed_gives_same_tokens(client):
    body = {"token_ids": [3, 4], "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 7}}
    first, again = _generate(client, body), _generate(client, body)
    other = _generate(client, {**body, "sampling_params": {**body["sampling_params"], "seed": 8}})
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    assert other["choices"][0]["token_ids"] != first["choices"][0]["token_ids"]


def test_sampling_params_map_to_the_engines(client, upstream):
    _generate(client, {"token_ids": [1], "cache_salt": "tenant-a", "sampling_params": {
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.2,
        "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 3, "max_tokens": 2, "min_tokens": 1,
        "ignore_eos": True, "stop_token_ids": [9], "logit_bias": {"7": -100}, "skip_special_tokens": False,
        "structured_outputs": {"regex": "a+"}, "stop": [], "bad_words": [], "output_kind": 2}})
    sent = upstream.pipeline.engine.requests[-1]
    params = sent.sampling_params
    assert sent.cache_salt == "tenant-a"
    assert (round(params.temperature, 3), round(params.top_p, 3), params.top_k, params.seed, params.max_tokens,
            params.min_tokens, params.ignore_eos, list(params.stop_token_ids)) == (0.5, 0.9, 5, 3, 2, 1, True, [9])
    assert dict(params.logit_bias) == {7: -100.0} and params.structured_output.regex == "a+"


def test_features_become_the_engines_items_in_prompt_order(client, upstream):
    features = {"mm_hashes": {"image": ["ab" * 16, "cd" * 16]},
                "mm_placeholders": {"image": [{"offset": 5, "length": 2}, {"offset": 1, "length": 3,
                                                                            "is_embed": [True, False, True]}]}}
    _generate(client, {"token_ids": list(range(8)), "features": features, "sampling_params": {"max_tokens": 1}})
    items = upstream.pipeline.engine.requests[-1].mm_features.items
    assert [(item.mm_hash, item.placeholder.offset, item.placeholder.length) for item in items] == [
        ("cd" * 16, 1, 3), ("ab" * 16, 5, 2)]
    assert list(items[0].placeholder.is_embed) == [True, False, True]


def test_abort_reaches_the_engine_by_either_id(client, upstream):
    reply = client.post("/inference/v1/abort_requests", json={"request_ids": ["a", "generate-tokens-b"]})
    assert reply.status_code == 200
    assert upstream.pipeline.engine.aborted == ["a", "b"]
    missing = client.post("/inference/v1/abort_requests", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_ids"


def _derender_chat(client, answer: dict, prompt_ids: list[int] | None, chat: dict = CHAT) -> dict:
    body = {"generate_response": answer, "prompt_tokens": len(prompt_ids or [0, 0]), "chat_request": chat}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    reply = client.post("/v1/chat/completions/derender", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_derender_chat_renders_the_chat_request_for_its_context(client, upstream):
    rendered = _rendered(client)
    answer = _generate(client, rendered)
    body = _derender_chat(client, answer, None)
    ids = answer["choices"][0]["token_ids"]
    assert body["choices"][0]["message"]["content"] == "".join(f"<{t}>" for t in ids)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["id"] == answer["request_id"]
    assert upstream.pipeline.render.calls["RenderChat"] == 2  # the render endpoint's, then derender's context


def test_derender_chat_takes_the_context_the_render_endpoint_kept_for_the_chat(client, upstream):
    """The chat and prompt the render endpoint answered: derender's context is the one render gave
    then (render is not asked again), the same context a fresh render gives."""
    rendered = _rendered(client)
    answer = _generate(client, rendered)
    kept = _derender_chat(client, answer, rendered["token_ids"])
    assert upstream.pipeline.render.calls["RenderChat"] == 1
    ids = answer["choices"][0]["token_ids"]
    assert kept["choices"][0]["message"]["content"] == "".join(f"<{t}>" for t in ids)
    assert kept["usage"]["prompt_tokens"] == len(rendered["token_ids"]) and kept["usage"]["completion_tokens"] == 3
    _derender_chat(client, answer, None)  # no prompt ids: rendered now
    assert upstream.pipeline.render.calls["RenderChat"] == 2
    from_kept, fresh = upstream.pipeline.derender.contexts[-2:]
    assert from_kept.reasoning_parser == fresh.reasoning_parser and from_kept.tools == fresh.tools
    from_kept.request_id = fresh.request_id = ""  # render's own id for the call: logs only
    from_kept.prompt_tokens = fresh.prompt_tokens = 0  # the callers' counts, told apart above
    assert from_kept == fresh


def test_derender_chat_renders_when_no_answer_is_kept_for_its_chat_and_prompt(client, upstream):
    rendered = _rendered(client)
    answer = _generate(client, rendered)
    _derender_chat(client, answer, [40, 41])  # another prompt
    _derender_chat(client, answer, rendered["token_ids"], {**CHAT, "max_tokens": 4})  # another chat
    assert upstream.pipeline.render.calls["RenderChat"] == 3


def test_a_kept_context_takes_the_derender_calls_stream_options(client, upstream):
    """Stream options are not part of the kept answer's key: a streamed derender's first chunk
    asks for usage in every chunk by its own chat_request, whatever the render call asked."""
    rendered = _rendered(client)
    chat = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    reply = client.post("/v1/chat/completions/derender", json={
        "stream": True, "chat_request": chat, "prompt_token_ids": rendered["token_ids"],
        "generate_chunk": {"request_id": "x", "choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]}})
    assert reply.status_code == 200, reply.text
    assert upstream.pipeline.render.calls["RenderChat"] == 1
    assert upstream.pipeline.derender.contexts[-1].usage_in_every_chunk
    # the kept answer itself is unchanged: each later derender of the chat has its own choices and options
    two = _generate(client, {**rendered, "sampling_params": {**rendered.get("sampling_params", {}), "n": 2}})
    _derender_chat(client, two, rendered["token_ids"])
    assert upstream.pipeline.derender.contexts[-1].n == 2
    _derender_chat(client, _generate(client, rendered), rendered["token_ids"])
    assert upstream.pipeline.render.calls["RenderChat"] == 1
    last = upstream.pipeline.derender.contexts[-1]
    assert last.n == 1 and not last.usage_in_every_chunk


def test_derender_chat_without_chat_request_decodes_plainly(client, upstream):
    answer = _generate(client, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    reply = client.post("/v1/chat/completions/derender", json={"generate_response": answer})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "<3><4>"
    assert upstream.pipeline.render.calls["RenderChat"] == 0


def test_derender_completion_numbers_choices_per_prompt(client):
    answers = [_generate(client, {"token_ids": [p], "sampling_params": {"max_tokens": 1, "n": 2}})
               for p in (10, 20)]
    reply = client.post("/v1/completions/derender", json={
        "generate_responses": answers, "prompt_tokens": [1, 1],
        "completion_request": {"model": SERVED, "prompt": "x", "stop": ["zz"]}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "<11>"), (1, "<12>"), (2, "<21>"), (3, "<22>")]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4


# -- hostile input: 4xx in vLLM's error shape, naming the field ---------------------------------

BAD_GENERATE = [
    ({"token_ids": [True], "sampling_params": {}}, 400, "token_ids[0]"),
    ({"token_ids": [1.0], "sampling_params": {}}, 400, "token_ids[0]"),
    ({"token_ids": [-1], "sampling_params": {}}, 400, "token_ids[0]"),
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": "12", "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1]}, 400, "sampling_params"),
    ({"token_ids": [1, VOCAB], "sampling_params": {}}, 400, "token_ids[1]"),
    ({"token_ids": [1], "sampling_params": {"stop": ["x"]}}, 400, "sampling_params.stop"),
    ({"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}, 400, "sampling_params.prompt_logprobs"),
    ({"token_ids": [1], "sampling_params": {"logprobs": -1}}, 400, "sampling_params.logprobs"),
    ({"token_ids": [1], "sampling_params": {"temprature": 1}}, 400, "sampling_params.temprature"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "8"}}, 400, "sampling_params.max_tokens"),
    ({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, 400,
     "sampling_params.structured_outputs"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, 400, "output_mode"),
    ({"token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "image_url", "url": "x"}]}, 400,
     "content_parts"),  # token_ids hold no placeholder for the image
    ({"token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "audio_url", "url": "x"}]}, 400,
     "content_parts[0].type"),
    ({"token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "image_url", "url": "x", "uuid": "u"}]},
     400, "content_parts[0].uuid"),
    ({"token_ids": [1], "sampling_params": {}, "content_parts": "x"}, 400, "content_parts"),
    ({"token_ids": [1, 2], "sampling_params": {}, "content_parts": [{"type": "image_url", "url": "x"}],
      "features": {"mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}},
     400, "content_parts"),
    ({"token_ids": [1], "sampling_params": {}, "kv_transfer_params": {"do_remote_decode": "yes"}}, 400,
     "kv_transfer_params.do_remote_decode"),
    ({"token_ids": [1], "sampling_params": {}, "priority": 3}, 400, "priority"),
    ({"token_ids": [1], "sampling_params": {}, "model": "other"}, 404, None),
    ({"token_ids": [1], "sampling_params": {}, "cache_salt": ""}, 400, "cache_salt"),
    ({"token_ids": [1], "sampling_params": {}, "surprise": 1}, 400, "surprise"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 1, "length": 5}]}}}, 400,
     "features.mm_placeholders.image[0]"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"video": [{"offset": 0, "length": 1}]}}}, 400,
     "features.mm_placeholders"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16, "cd" * 16]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}},
     400, "features.mm_placeholders.image"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
        "kwargs_data": {"image": ["%%%not base64%%%"]}}}, 400, "features.kwargs_data.image[0]"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
        "kwargs_data": {"video": [None]}}}, 400, "features.kwargs_data"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
        "mm_metadata": {"image": [None, None]}}}, 400, "features.mm_metadata.image"),
    ({"token_ids": [1, 2, 3], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16, "cd" * 16]},
        "mm_placeholders": {"image": [{"offset": 0, "length": 2}, {"offset": 1, "length": 2}]}}}, 400,
     "features.mm_placeholders"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"audio3d": ["ab" * 16]}, "mm_placeholders": {"audio3d": [{"offset": 0, "length": 1}]}}}, 400,
     "features.mm_hashes.audio3d"),
    ({"token_ids": [1, 2], "sampling_params": {}, "features": {
        "mm_hashes": {"image": ["ab" * 16]},
        "mm_placeholders": {"image": [{"offset": 0, "length": 2, "is_embed": [True]}]}}}, 400,
     "features.mm_placeholders.image[0].is_embed"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_GENERATE)
def test_bad_generate_bodies_are_refused_naming_the_field(client, body, status, param):
    reply = client.post("/inference/v1/generate", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["param"] == param
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")


def test_hostile_bodies_are_refused_before_any_service(client, upstream):
    huge = client.post("/inference/v1/generate", content=b"{\"token_ids\": [" + b"1," * 40_000 + b"1]}")
    assert huge.status_code == 413 and huge.json()["error"]["code"] == 413
    deep = client.post("/inference/v1/generate", content=b"[" * 200 + b"]" * 200)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == 400
    assert client.post("/v1/chat/completions/render", content=b"{not json").status_code == 400
    assert upstream.pipeline.engine.requests == [] and upstream.pipeline.render.calls["RenderChat"] == 0


def test_bad_render_and_derender_bodies(client):
    unknown = client.post("/v1/chat/completions/render", json={**CHAT, "mm_payload": "pixels"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "mm_payload"
    chunk = {"request_id": "x", "choices": [{"index": 0, "token_ids": [1], "finish_reason": None}]}
    for state, param in (({"output_token_ids": []}, "stream_state"), ("!!not base64", "stream_state"),
                         (12, "stream_state")):
        refused = client.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": chunk,
                                                                     "stream_state": state})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    two = client.post("/v1/completions/derender", json={"stream": True, "generate_chunk": {
        "choices": [chunk["choices"][0], {**chunk["choices"][0], "index": 1}]}})
    assert two.status_code == 400 and two.json()["error"]["param"] == "generate_chunk.choices"
    bad_ids = client.post("/v1/chat/completions/derender", json={"generate_response": {
        "request_id": "x", "choices": [{"index": 0, "token_ids": [True]}]}})
    assert bad_ids.status_code == 400
    assert bad_ids.json()["error"]["param"] == "generate_response.choices[0].token_ids[0]"
    mismatched = client.post("/v1/completions/derender", json={"generate_responses": [{"choices": []}],
                                                               "prompt_tokens": [1, 2]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "prompt_tokens"


# -- the chat's reuse path: kv_transfer_params.prompt_token_ids ----------------------------------

def _chat(client, body: dict) -> dict:
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_forwarded_ids_skip_render_and_give_the_plain_chats_answer(client, upstream):
    plain = _chat(client, CHAT)
    rendered = _rendered(client)
    calls = dict(upstream.pipeline.render.calls)
    reused = _chat(client, {**CHAT, "kv_transfer_params": {"prompt_token_ids": rendered["token_ids"]}})
    assert upstream.pipeline.render.calls == calls  # render was not called again
    assert reused["choices"][0]["message"] == plain["choices"][0]["message"]
    assert reused["usage"] == plain["usage"]
    first, last = upstream.pipeline.engine.requests[0], upstream.pipeline.engine.requests[-1]
    assert list(last.token_ids) == list(first.token_ids) == rendered["token_ids"]
    assert last.sampling_params == first.sampling_params


def test_forwarded_ids_without_a_kept_render_run_as_forwarded(client, upstream):
    reused = _chat(client, {**CHAT, "kv_transfer_params": {"prompt_token_ids": [40, 41]}})
    assert upstream.pipeline.render.calls["RenderChat"] == 1  # derender's context: render's answer
    assert list(upstream.pipeline.engine.requests[-1].token_ids) == [40, 41]
    assert reused["choices"][0]["message"]["content"] == "<42><43><44>"
    assert reused["usage"]["prompt_tokens"] == 2


def test_a_media_chat_with_forwarded_ids_is_rendered(client, upstream):
    media = {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
        "kv_transfer_params": {"prompt_token_ids": [40, 41]}}
    _chat(client, media)
    assert upstream.pipeline.render.calls["RenderChat"] == 1
    assert list(upstream.pipeline.engine.requests[-1].token_ids) != [40, 41]


@pytest.mark.parametrize("ids", [[True], [1.0], [-1], [], "12", [1, None]])
def test_bad_forwarded_ids_are_refused(client, upstream, ids):
    reply = client.post("/v1/chat/completions", json={**CHAT, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"
    assert upstream.pipeline.engine.requests == []


def test_forwarded_ids_outside_the_vocabulary_are_refused(client, upstream):
    outside = client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                        "kv_transfer_params": {"prompt_token_ids": [1, VOCAB]}})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"
    assert upstream.pipeline.engine.requests == []


# -- the chat's prefill/decode part: kv_transfer_params as vLLM's P/D proxies send them ----------

def test_a_prefill_chat_runs_as_the_engines_prefill_and_answers_the_handoff(client, upstream):
    answer = _chat(client, {**CHAT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    sent = upstream.pipeline.engine.requests[-1]
    assert sent.kv_transfer.WhichOneof("role") == "prefill"
    assert json.loads(sent.kv_transfer.connector_params_json) == {"do_remote_decode": True}
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["tito_kv_handle"]["transfer_id"] == f"t-{sent.request_id}"
    assert f"{params['remote_host']}:{params['remote_port']}" == ENGINE_ADDRESS
    plain = _chat(client, CHAT)
    assert "kv_transfer_params" not in plain  # only a prefill/decode part answers it


def test_a_streamed_prefill_chat_carries_the_handoff_on_the_chunk_that_ends_it(client, upstream):
    reply = client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                      "kv_transfer_params": {"do_remote_decode": True}})
    events = _events(reply)
    handed = [event for event in events if "kv_transfer_params" in event]
    assert len(handed) == 1 and handed[0]["choices"][0]["finish_reason"] == "length"
    assert handed[0]["kv_transfer_params"]["tito_kv_handle"]["engine_id"] == "fake-engine"


def test_a_decode_chat_carries_forwarded_ids_and_the_handle_together(client, upstream):
    handle = {"transfer_id": "t1", "engine_id": "e1"}
    answer = _chat(client, {**CHAT, "kv_transfer_params": {
        "prompt_token_ids": [40, 41, 42], "do_remote_prefill": True, "tito_kv_handle": handle,
        "remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 7000}})
    sent = upstream.pipeline.engine.requests[-1]
    assert list(sent.token_ids) == [40, 41, 42]
    assert sent.kv_transfer.decode.handle.transfer_id == "t1"
    assert sent.kv_transfer.decode.source_address == "10.0.0.1:7000"
    assert "prompt_token_ids" not in json.loads(sent.kv_transfer.connector_params_json)  # the reuse keys stay here
    assert answer["kv_transfer_params"] is None


@pytest.mark.parametrize(("params", "param"), [
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_prefill": True, "tito_kv_handle": "x", "remote_host": "h"}, "kv_transfer_params.tito_kv_handle"),
    ({"do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x"}, "remote_host": "h", "remote_port": 0},
     "kv_transfer_params.remote_port"),
    ({"prompt_token_ids": [1], "do_remote_prefill": True, "tito_kv_handle": {"transfer_id": "x"}},
     "kv_transfer_params.remote_host"),
    ([1], "kv_transfer_params"),
])
def test_bad_transfer_params_on_the_chat_are_400s_naming_the_key(client, upstream, params, param):
    reply = client.post("/v1/chat/completions", json={**CHAT, "kv_transfer_params": params})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert upstream.pipeline.engine.requests == []


def test_a_completion_is_a_prefill_part_too_with_one_prompt(client, upstream):
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    sent = upstream.pipeline.engine.requests[-1]
    assert sent.kv_transfer.WhichOneof("role") == "prefill"
    assert reply.json()["kv_transfer_params"]["tito_kv_handle"]["transfer_id"] == f"t-{sent.request_id}"
    events = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert [event["kv_transfer_params"]["remote_port"] for event in events if "kv_transfer_params" in event] == [
        int(ENGINE_ADDRESS.rsplit(":", 1)[1])]
    several = client.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
    assert several.status_code == 400 and several.json()["error"]["param"] == "kv_transfer_params"
    assert "kv_transfer_params" not in _plain_completion(client)


def _plain_completion(client) -> dict:
    reply = client.post("/v1/completions", json={"model": SERVED, "prompt": "Hello", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_cache_salt_reaches_the_engine_from_the_chat_and_the_reuse_path(client, upstream):
    _chat(client, {**CHAT, "cache_salt": "tenant-a"})
    assert upstream.pipeline.engine.requests[-1].cache_salt == "tenant-a"
    _chat(client, {**CHAT, "cache_salt": "tenant-b", "kv_transfer_params": {"prompt_token_ids": [40, 41]}})
    assert upstream.pipeline.engine.requests[-1].cache_salt == "tenant-b"


# -- the chat's echo: vLLM's (serving_chat) ------------------------------------------------------

CONTINUED = {**CHAT, "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi th"}],
             "add_generation_prompt": False, "continue_final_message": True}


def test_echo_starts_the_answer_with_the_last_message_of_the_answers_role(client):
    plain = _chat(client, CONTINUED)["choices"][0]["message"]["content"]
    echoed = _chat(client, {**CONTINUED, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "Hi th" + plain
    parts = {**CONTINUED, "echo": True, "messages": [CONTINUED["messages"][0], {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert _chat(client, parts)["choices"][0]["message"]["content"].startswith("a\nb")
    # The answer's role is `assistant` with a generation prompt: a user's last message is not echoed.
    assert _chat(client, {**CHAT, "echo": True})["choices"][0]["message"]["content"] == _chat(
        client, CHAT)["choices"][0]["message"]["content"]


def test_a_streamed_echo_is_a_chunk_per_choice_after_the_role_chunks(client):
    events = _events(client.post("/v1/chat/completions", json={**CONTINUED, "echo": True, "n": 2, "stream": True}))
    deltas = [(event["choices"][0]["index"], event["choices"][0]["delta"]) for event in events[:4]]
    assert deltas == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                      (0, {"content": "Hi th"}), (1, {"content": "Hi th"})]


def test_without_a_generation_prompt_the_answer_has_the_last_messages_role_and_echoes_it(client):
    continued = {**CHAT, "add_generation_prompt": False}  # the model continues the user's turn
    assert _chat(client, continued)["choices"][0]["message"]["role"] == "user"
    message = _chat(client, {**continued, "echo": True})["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Hello")
    events = _events(client.post("/v1/chat/completions", json={**continued, "echo": True, "stream": True}))
    assert [event["choices"][0]["delta"] for event in events[:2]] == [{"role": "user", "content": ""},
                                                                      {"content": "Hello"}]
    assert all("role" not in event["choices"][0]["delta"] for event in events[1:] if event["choices"])


def test_echo_renders_a_chat_with_forwarded_ids_and_a_wrong_echo_is_a_400(client, upstream):
    _chat(client, {**CONTINUED, "echo": True, "kv_transfer_params": {"prompt_token_ids": [40, 41]}})
    assert upstream.pipeline.render.calls["RenderChat"] == 1  # rendered, the ids ignored (as vLLM)
    assert list(upstream.pipeline.engine.requests[-1].token_ids) != [40, 41]
    # ...unchecked, as vLLM's renderer drops them before its checks when echo is on
    _chat(client, {**CONTINUED, "echo": True, "kv_transfer_params": {"prompt_token_ids": [True, -1]}})
    assert upstream.pipeline.render.calls["RenderChat"] == 2
    bad = client.post("/v1/chat/completions", json={**CHAT, "echo": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"


# -- tools on the Messages and Responses render endpoints: the chat vLLM converts them to --------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_messages_tools_and_tool_blocks_become_vllms_chat():
    from tito_gateway.vllm_api import messages_in

    chat = messages_in.to_chat({"model": SERVED, "max_tokens": 4, "tools": [
        {"name": "weather", "description": "The weather.", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask the tool."},
                                          {"type": "tool_use", "id": "t1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "20C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "Rain"}]}]})
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER,
                                                               "description": "The weather."}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning": "Ask the tool.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny\n20C"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "tool", "tool_call_id": "t2", "content": "Rain"}]  # a user turn of results only: no user message
    named = messages_in.to_chat({"max_tokens": 1, "messages": [], "tools": [{"name": "f", "input_schema": {}}],
                                 "tool_choice": {"type": "tool", "name": "f"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert messages_in.to_chat({"max_tokens": 1, "messages": [], "tools": []})["tool_choice"] == "auto"


def test_responses_tools_and_call_items_become_vllms_chat():
    from tito_gateway.vllm_api import responses_in

    tool = {"type": "function", "name": "weather", "description": "The weather.", "parameters": WEATHER}
    chat = responses_in.to_chat({"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"role": "assistant", "content": "Sunny in Paris."}], "tools": [tool],
        "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": False})
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "description": "The weather.",
                                                               "parameters": WEATHER}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False
    calls = [{"id": c, "type": "function", "function": {"name": "weather", "arguments": f'{{"city":"{city}"}}'}}
             for c, city in (("c1", "Paris"), ("c2", "Lyon"))]
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}, {"role": "assistant", "content": "Sunny in Paris."}]


class StatusLosingDerender(FakeDerender):
    """Derender refusing a resumed state as grpc's asyncio client can report it (grpc/grpc#36066):
    with the chunk's responses still being written, the status comes back INTERNAL "Internal error
    from Core"; the context sent alone gets derender's own refusal."""

    def __init__(self):
        self.calls = 0

    def Derender(self, requests, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.calls += 1
        return self._refuse(requests)

    async def _refuse(self, requests):
        if len([message async for message in requests]) > 1:
            raise FakeRpcError(code=grpc.StatusCode.INTERNAL, details="Internal error from Core")
        raise FakeRpcError(InvalidArgument("the stream state's integrity tag does not match",
                                           reason="STREAM_STATE_INVALID", field="context.resume_state"))
        yield  # an async generator, as the stub's stream is


def test_a_refused_state_is_a_400_even_when_grpc_loses_derenders_status(upstream, client):
    upstream.pipeline.derender = StatusLosingDerender()
    chunk = {"request_id": "x", "choices": [{"index": 0, "token_ids": [1], "finish_reason": None}]}
    state = base64.urlsafe_b64encode(b"sealed by another key" * 3).decode()
    reply = client.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": chunk,
                                                               "stream_state": state})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "stream_state" and "integrity tag" in reply.json()["error"]["message"]
    assert upstream.pipeline.derender.calls == 2  # the lost status, then the state checked alone
