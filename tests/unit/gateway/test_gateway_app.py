"""The gateway's endpoints over a fake of the services: the model list as a readiness signal, and
OpenAI's own answer to a model it does not serve."""

from __future__ import annotations

import time

import pytest

from gateway_fakes import SERVED
from starlette.testclient import TestClient
from tito_gateway.app import ADAPTERS_MIN_AGE, Gateway


def test_an_unknown_model_is_answered_as_openai_answers_it(client):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        reply = client.post(path, json={"model": "gpt-4o", **body})
        assert reply.status_code == 404
        assert reply.json() == {"error": {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


@pytest.mark.parametrize("states, code", [
    ({"engine": "NOT_SERVING"}, "MODEL_LOADING"),  # the engine is loading its model
    ({"render": "NOT_SERVING", "engine": "NOT_SERVING"}, "MODEL_LOADING"),
    ({"derender": "UNAVAILABLE"}, "UPSTREAM_ERROR"),  # not listening (yet)
])
def test_the_model_list_answers_only_when_health_would(client, upstream, states, code):
    """Clients poll /v1/models for readiness (vLLM's server listens only once loaded): while any
    service is not serving it is a 503, as /health is, so the chat sent after a 200 is served."""
    upstream.states.update(states)
    assert client.get("/health").status_code == 503
    reply = client.get("/v1/models")
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["type"] == "server_error"
    assert all(name in error["message"] for name in states)
    upstream.states.update(dict.fromkeys(states, "SERVING"))
    assert client.get("/health").status_code == 200
    reply = client.get("/v1/models")
    assert reply.status_code == 200
    assert [model["id"] for model in reply.json()["data"]] == [SERVED]
    assert client.post("/v1/chat/completions", json={"model": SERVED, "messages": [
        {"role": "user", "content": "Hi"}]}).status_code == 200


def test_a_model_naming_a_lora_adapter_selects_it_and_the_list_names_its_parent(client, upstream):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json={"model": "sql", **chat}).status_code == 404  # not held yet
    upstream.adapters = ["sql"]  # loaded on an engine since: the gateway asks again for a name it lacks
    time.sleep(ADAPTERS_MIN_AGE)
    assert client.post("/v1/chat/completions", json={"model": "sql", **chat}).status_code == 200
    assert client.post("/v1/completions", json={"model": "sql", "prompt": "Hi"}).status_code == 200
    assert client.post("/v1/chat/completions", json={"model": SERVED, **chat}).status_code == 200
    assert [request.lora_name for request in upstream.pipeline.requests] == ["sql", "sql", ""]
    asked = upstream.adapter_lists
    client.post("/v1/chat/completions", json={"model": SERVED, **chat})
    assert upstream.adapter_lists == asked  # the served model never asks the engines
    models = client.get("/v1/models").json()["data"]
    assert [(model["id"], model.get("parent"), model.get("root")) for model in models] == [
        (SERVED, None, None), ("sql", SERVED, "adapters/sql")]


def test_vllms_lora_loading_endpoints_only_where_the_operator_allows_them(client, upstream):
    body = {"lora_name": "sql", "lora_path": "sql-r16"}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 404  # off by default
    with TestClient(Gateway(upstream, lora_updating=True).asgi(), raise_server_exceptions=False) as http:
        reply = http.post("/v1/load_lora_adapter", json=body)
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        chat = {"model": "sql", "messages": [{"role": "user", "content": "Hi"}]}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200  # usable at once
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "lora_path")
        reply = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert upstream.adapters == []
