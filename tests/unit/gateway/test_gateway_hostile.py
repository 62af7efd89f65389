"""Hostile JSON at every position of a request: a lone UTF-16 surrogate in every string and key,
and nesting 60, 500 and 100,000 deep in place of every value, in a chat and completions that use
every parameter the gateway accepts. Each is a 400 in OpenAI's error shape naming where it is (or
the Struct that holds it; nothing where the JSON parser itself gave up), never a 5xx."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from gateway_fakes import SERVED
from tito.json_text import MAX_JSON_DEPTH, MAX_STRUCT_DEPTH
from tito_gateway.openai_in import CHAT_PARAMETERS, COMPLETION_PARAMETERS, MESSAGE_FIELDS, MESSAGE_NULL_FIELDS, NO_OPS

SURROGATE = "\ud800"
#: Stands for the hostile value in a body's text until it is written in (a JSON string no real body holds).
MARK = "\"__hostile__\""
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
          "required": ["city"]}

FULL_CHAT: dict[str, Any] = {
    "model": SERVED,
    "messages": [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "auto"}},
            {"type": "image_url", "image_url": "data:image/png;base64,AA"}]},
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "refusal": None, "audio": None,
         "annotations": None, "function_call": None,
         "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                         "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "content": "Rain.", "reasoning_content": "It said rain."},
        {"role": "user", "content": "And tomorrow?"}],
    "stream": True,
    "max_completion_tokens": 8, "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
    "n": 2, "seed": 3, "stop": ["\n\n", "END"], "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": False, "stop_token_ids": [7],
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "logprobs": True, "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "weather", "description": "The weather of a city.",
                                                "parameters": SCHEMA, "strict": True}}],
    "tool_choice": {"type": "function", "function": {"name": "weather"}}, "parallel_tool_calls": True,
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "description": "An answer.",
                                                               "schema": SCHEMA, "strict": True}},
    "chat_template_kwargs": {"enable_thinking": False, "style": {"tone": ["dry"]}},
    "chat_template": "{{ messages[0].content }}", "add_generation_prompt": True, "continue_final_message": False,
    "user": "user-1", "cache_salt": "salt", "metadata": {"team": "search"}, "service_tier": "auto", "store": False,
    "logit_bias": {"5": -1.5, "7": 2},
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}

_COMPLETION_COMMON: dict[str, Any] = {
    "model": SERVED, "stream": True, "stream_options": {"include_usage": True},
    **{name: FULL_CHAT[name] for name in COMPLETION_PARAMETERS if name in FULL_CHAT and name not in
       ("model", "stream", "stream_options", "logprobs")},
    "logprobs": 2, "add_special_tokens": True,
    "echo": False, "suffix": "", "best_of": 1,  # the last two refused, in the values that ask for nothing
}
FULL_COMPLETIONS = {"text": {**_COMPLETION_COMMON, "prompt": ["Once upon a time"]},
                    "token ids": {**_COMPLETION_COMMON, "prompt": [[1, 2, 3]]}}

REQUESTS = [("/v1/chat/completions", "chat", FULL_CHAT),
            *(("/v1/completions", f"completion of {kind}", body) for kind, body in FULL_COMPLETIONS.items())]


def _path(positions: tuple) -> str:
    """The gateway's name of a position: `messages[1].content[0].text`."""
    text = ""
    for position in positions:
        text += f"[{position}]" if isinstance(position, int) else (f".{position}" if text else position)
    return text


def _values(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """The position of every value inside `value` (itself excluded), outermost first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for position, item in items:
        yield (*at, position)
        yield from _values(item, (*at, position))


def _objects(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """The position of every object inside `value` (itself included)."""
    if isinstance(value, dict):
        yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for position, item in items:
        yield from _objects(item, (*at, position))


def _replaced(body: dict, at: tuple, text: str) -> bytes:
    """`body` as JSON text with the value at `at` replaced by the JSON text `text`."""
    copy = json.loads(json.dumps(body))
    holder = copy
    for position in at[:-1]:
        holder = holder[position]
    holder[at[-1]] = "__hostile__"
    return json.dumps(copy).replace(MARK, text).encode()


def _with_key(body: dict, at: tuple) -> tuple[bytes, str]:
    """`body` as JSON text with every key of the object at `at` prefixed by a lone surrogate (an
    empty object gets the key alone); and the first such key, as the gateway names it."""
    copy = json.loads(json.dumps(body))
    holder = copy
    for position in at:
        holder = holder[position]
    renamed = {SURROGATE + name: item for name, item in holder.items()} or {SURROGATE: 1}
    holder.clear()
    holder.update(renamed)
    first = next(iter(renamed)).replace(SURROGATE, "\\ud800")
    return json.dumps(copy).encode(), first  # ensure_ascii: the surrogate goes as the escape \ud800


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def _refused(client, path: str, body: bytes) -> dict:
    reply = client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, (reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def _related(param: str, position: str) -> bool:
    """The refusal names the position, a place inside it, or the Struct that holds it (logit_bias's
    keys are token ids, named as indices: `logit_bias[5]` for the position `logit_bias.5`)."""
    param = re.sub(r"\[(\d+)\]", r".\1", param)
    position = re.sub(r"\[(\d+)\]", r".\1", position)
    return param.startswith(position) or position.startswith(param)


def test_the_full_requests_use_every_parameter_and_are_served(client, upstream):
    """The walks below reach every position the gateway reads: the bodies hold every parameter it
    accepts (a new one must join them) and are served whole."""
    assert CHAT_PARAMETERS <= FULL_CHAT.keys()
    assert MESSAGE_FIELDS | MESSAGE_NULL_FIELDS <= {key for message in FULL_CHAT["messages"] for key in message}
    for body in FULL_COMPLETIONS.values():
        assert COMPLETION_PARAMETERS | (NO_OPS.keys() - {"parallel_tool_calls"}) <= body.keys()
    for path, _, body in REQUESTS:
        reply = client.post(path, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.text.endswith("data: [DONE]\n\n")
    assert len(upstream.pipeline.requests) == len(REQUESTS)


@pytest.mark.parametrize("path, name, body", REQUESTS, ids=[name for _, name, _ in REQUESTS])
def test_a_lone_surrogate_in_any_value_is_a_400_naming_it(client, upstream, path, name, body):
    positions = list(_values(body))
    for at in positions:
        error = _refused(client, path, _replaced(body, at, json.dumps(SURROGATE)))
        assert (error["code"], error["param"]) == ("INVALID_REQUEST", _path(at)), error
        assert "surrogate" in error["message"]
    assert not upstream.pipeline.requests


@pytest.mark.parametrize("path, name, body", REQUESTS, ids=[name for _, name, _ in REQUESTS])
def test_a_lone_surrogate_in_any_key_is_a_400_naming_it(client, upstream, path, name, body):
    for at in _objects(body):
        hostile, key = _with_key(body, at)
        error = _refused(client, path, hostile)
        assert (error["code"], error["param"]) == ("INVALID_REQUEST", _path((*at, key))), error
    assert not upstream.pipeline.requests


@pytest.mark.parametrize("levels", [MAX_STRUCT_DEPTH + 28, 500, 100_000])
@pytest.mark.parametrize("path, name, body", REQUESTS, ids=[name for _, name, _ in REQUESTS])
def test_nesting_in_place_of_any_value_is_a_400(client, upstream, path, name, body, levels):
    """60 levels (inside the body's limit, past a Struct's): a type error or STRUCT_TOO_DEEP naming
    the position or the Struct that holds it; 500, past the body's limit: JSON_TOO_DEEP naming the
    first place too deep inside the position; 100,000, past the parser's own recursion:
    JSON_TOO_DEEP (the parser gave up before a place could be named)."""
    for at in _values(body):
        error = _refused(client, path, _replaced(body, at, _nested(levels)))
        if levels > 1000:
            assert (error["code"], error["param"]) == ("JSON_TOO_DEEP", None), error
        elif len(at) + levels > MAX_JSON_DEPTH:
            assert error["code"] == "JSON_TOO_DEEP" and error["param"].startswith(_path(at)), (error, _path(at))
        else:
            assert error["code"] != "JSON_TOO_DEEP" and _related(error["param"], _path(at)), (error, _path(at))
    assert not upstream.pipeline.requests


STRUCTS = ["tools[0].function.parameters", "response_format.json_schema.schema", "chat_template_kwargs",
           "messages[2].tool_calls[1].function.arguments"]


def _schema(levels: int) -> str:
    """A JSON schema `levels` objects deep (arrays of arrays of ... strings)."""
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "string"}' + "}" * (levels - 1)


@pytest.mark.parametrize("levels", [MAX_STRUCT_DEPTH + 1, 60, 450])
@pytest.mark.parametrize("struct", STRUCTS)
def test_a_struct_nested_past_the_limit_is_a_400_naming_it(client, upstream, struct, levels):
    """Nested schemas, tool parameters, template kwargs and arguments (each becomes a protobuf
    Struct): STRUCT_TOO_DEEP naming the Struct, as render refuses it, while the body holds them;
    JSON_TOO_DEEP naming a place inside it past that."""
    at = next(at for at in _values(FULL_CHAT) if _path(at) == struct)
    error = _refused(client, "/v1/chat/completions", _replaced(FULL_CHAT, at, _schema(levels)))
    if len(at) + levels <= MAX_JSON_DEPTH:  # the body object is level 1, the Struct level len(at) + 1
        assert (error["code"], error["param"]) == ("STRUCT_TOO_DEEP", struct), error
        assert f"nests deeper than {MAX_STRUCT_DEPTH} levels" in error["message"]
    else:
        assert error["code"] == "JSON_TOO_DEEP" and error["param"].startswith(struct + ".items.items"), error
    assert not upstream.pipeline.requests


@pytest.mark.parametrize("struct", STRUCTS)
def test_a_struct_at_the_limit_is_served(client, upstream, struct):
    at = next(at for at in _values(FULL_CHAT) if _path(at) == struct)
    reply = client.post("/v1/chat/completions", content=_replaced(FULL_CHAT, at, _schema(MAX_STRUCT_DEPTH)),
                        headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert len(upstream.pipeline.requests) == 1


@pytest.mark.parametrize("body", [
    b'{"model": "served-model", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # CESU: not UTF-8
    b'{"model": "served-model", "prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}",
    b'{"model": "served-model", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
])
def test_what_json_decoders_let_through_but_protobuf_cannot_carry_is_a_400(client, body):
    reply = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] in ("INVALID_JSON", "INVALID_REQUEST")


def test_a_surrogate_pair_is_one_character_and_served(client, upstream):
    body = json.dumps({"model": SERVED, "messages": [{"role": "user", "content": "party \U0001f389"}]})
    assert "\\ud83c\\udf89" in body
    assert client.post("/v1/chat/completions", content=body.encode()).status_code == 200
    assert upstream.pipeline.requests[0].messages[0].content == "party \U0001f389"
