"""OpenAI request bodies -> render's requests: every parameter mapped or refused by name."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from tito.errors import InvalidArgument, NotFound
from tito.json_text import MAX_JSON_DEPTH
from tito.v1 import chat_pb2
from tito_gateway.openai_in import parse_body, parse_chat, parse_completion

MODEL = "m"
HI = [{"role": "user", "content": "Hi"}]


def chat(**body):
    return parse_chat({"model": MODEL, "messages": HI, **body}, MODEL)


def test_sampling_parameters_reach_render_unchanged():
    call = chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, n=2, seed=3, stop="x",
                presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, min_tokens=1, ignore_eos=True,
                stop_token_ids=[4], skip_special_tokens=False, include_stop_str_in_output=True, logprobs=True,
                top_logprobs=2)
    s = call.request.sampling
    assert (s.max_tokens, s.top_k, s.n, s.seed, list(s.stop), list(s.stop_token_ids), s.top_logprobs) == \
        (7, 5, 2, 3, ["x"], [4], 2)
    assert s.temperature == 0.5 and s.ignore_eos and s.logprobs and not s.skip_special_tokens
    assert call.logprobs


def test_max_tokens_is_the_old_name_of_max_completion_tokens():
    assert chat(max_tokens=9).request.sampling.max_tokens == 9
    assert not chat().request.sampling.HasField("max_tokens")  # absent: up to the context limit


def test_logit_bias_string_keys_become_token_ids_on_chats_and_completions():
    bias = {"50256": -100, "7": 2.5, "0": 100.0}
    assert dict(chat(logit_bias=bias).request.sampling.logit_bias) == {50256: -100.0, 7: 2.5, 0: 100.0}
    completion = parse_completion({"model": MODEL, "prompt": "x", "logit_bias": bias}, MODEL)
    assert dict(completion.requests[0].sampling.logit_bias) == {50256: -100.0, 7: 2.5, 0: 100.0}
    assert not chat(logit_bias={}).request.sampling.logit_bias
    # A JSON integer past float's range goes on as infinity: render refuses it with every other bias out of range.
    assert dict(chat(logit_bias={"1": 10**400}).request.sampling.logit_bias) == {1: float("inf")}


@pytest.mark.parametrize("bias, param", [
    ([[1, 5]], "logit_bias"),
    ({"-1": 5}, "logit_bias"),
    ({"1.5": 5}, "logit_bias"),
    ({"token": 5}, "logit_bias"),
    ({"\u0663": 5}, "logit_bias"),  # an Arabic-Indic digit: int() would take it, OpenAI's ids are ASCII
    ({str(2**32): 5}, "logit_bias"),
    ({"9" * 5000: 5}, "logit_bias"),
    ({"3": "high"}, "logit_bias[3]"),
    ({"3": True}, "logit_bias[3]"),
    ({"3": None}, "logit_bias[3]"),
])
def test_a_logit_bias_protobuf_cannot_carry_is_an_invalid_request_naming_it(bias, param):
    with pytest.raises(InvalidArgument) as info:
        chat(logit_bias=bias)
    assert info.value.reason == "INVALID_REQUEST" and info.value.field == param


def test_null_means_not_given():
    call = chat(temperature=None, stop=None, tools=None, logit_bias=None, stream_options=None)
    assert not call.request.sampling.HasField("temperature") and not call.request.tools


@pytest.mark.parametrize("body, param", [
    ({"functions": []}, "functions"),
    ({"whatever": 1}, "whatever"),
    ({"messages": [{"role": "user", "content": "Hi", "refusal": "no"}]}, "messages[0].refusal"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
])
def test_unsupported_parameters_are_named(body, param):
    with pytest.raises(InvalidArgument) as info:
        chat(**body)
    assert info.value.reason == "UNSUPPORTED_PARAMETER" and info.value.field == param


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": True}, "n"),
    ({"seed": -1}, "seed"),
    ({"stop": 3}, "stop"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "tools[0].function.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "object"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": "true"}}},
     "response_format.json_schema.strict"),
    ({"store": "yes"}, "store"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"metadata": ["a"]}, "metadata"),
    ({"metadata": {"team": 1}}, "metadata.team"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "max"}}]}]},
     "messages[0].content[0].image_url.detail"),
])
def test_wrong_types_and_signs_are_invalid_requests_naming_the_parameter(body, param):
    with pytest.raises(InvalidArgument) as info:
        chat(**body)
    assert info.value.reason == "INVALID_REQUEST" and info.value.field == param


def test_account_parameters_are_accepted_and_not_used():
    plain = chat().request
    assert chat(user="u1", metadata={"team": "a"}, service_tier="flex", store=True).request == plain
    assert chat(store=False, service_tier="auto", metadata={}).request == plain
    completion = {"model": MODEL, "prompt": "x"}
    assert parse_completion({**completion, "user": "u1", "metadata": {"team": "a"}, "service_tier": "default",
                             "store": True}, MODEL).requests == parse_completion(completion, MODEL).requests


@pytest.mark.parametrize("detail", ["auto", "low", "high"])
def test_image_detail_is_accepted_and_left_to_the_models_processor(detail):
    url = "data:image/png;base64,AA"
    call = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url,
                                                                                         "detail": detail}}]}])
    assert call.request.messages[0].content_parts[0] == chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=url))


@pytest.mark.parametrize("options, continuous", [
    ({"include_usage": True, "continuous_usage_stats": True}, True),
    ({"continuous_usage_stats": True}, False),  # as vLLM: usage on every chunk only with include_usage
    ({"include_usage": True, "continuous_usage_stats": False}, False),
])
def test_continuous_usage_stats_asks_derender_for_usage_in_every_chunk(options, continuous):
    call = chat(stream=True, stream_options=options)
    assert call.stream.continuous_usage == continuous and call.request.usage_in_every_chunk == continuous
    several = completion(prompt=["a", "b"], stream=True, stream_options=options)
    assert [r.usage_in_every_chunk for r in several.requests] == [continuous] * 2


def test_the_model_must_be_the_served_one():
    with pytest.raises(NotFound) as info:
        parse_chat({"model": "other", "messages": HI}, MODEL)
    assert info.value.reason == "MODEL_NOT_FOUND" and info.value.field is None  # OpenAI's param is null
    assert info.value.message == "The model `other` does not exist or you do not have access to it."


def test_messages_tools_and_formats():
    call = chat(
        messages=[{"role": "system", "content": "s"},
                  {"role": "user", "content": [
                      {"type": "text", "text": "what?"},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
                  {"role": "assistant", "content": None, "reasoning": "hmm", "refusal": None,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                  {"role": "assistant", "content": "done", "reasoning_content": "old name"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        chat_template_kwargs={"enable_thinking": False})
    r = call.request
    assert r.messages[1].content_parts[1].image.url == "data:image/png;base64,AA"
    assert r.messages[2].reasoning_content == "hmm" and r.messages[2].tool_calls[0].function.arguments == '{"a": 1}'
    assert r.messages[3].tool_call_id == "c1" and r.messages[4].reasoning_content == "old name"
    assert r.tools[0].function.strict and r.tool_choice.function_name == "f" and not r.parallel_tool_calls
    assert json_format.MessageToDict(r.response_format.json_schema.schema) == {"type": "object"}
    assert r.chat_template_kwargs["enable_thinking"] is False
    assert chat(tool_choice="required").request.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED


def completion(**body):
    return parse_completion({"model": MODEL, **body}, MODEL)


def test_completion_prompts_text_or_token_ids():
    assert completion(prompt="hello").requests[0].prompt == "hello"
    assert list(completion(prompt=[1, 2, 3]).requests[0].prompt_token_ids) == [1, 2, 3]
    assert completion(prompt=["one"]).requests[0].prompt == "one"
    call = completion(prompt="x", logprobs=3, echo=False)
    assert call.logprobs == 3 and call.requests[0].sampling.top_logprobs == 3 and not call.echo


def test_several_prompts_are_one_render_request_each_with_the_same_options():
    call = completion(prompt=["a", [5, 6], "c"], n=2, max_tokens=4, seed=1, add_special_tokens=False, cache_salt="s")
    assert [(r.prompt, list(r.prompt_token_ids)) for r in call.requests] == [("a", []), ("", [5, 6]), ("c", [])]
    assert all(r.sampling == call.requests[0].sampling and not r.add_special_tokens and r.cache_salt == "s"
               for r in call.requests)
    assert call.n == 2
    call.set_request_id("r")  # each engine request needs its own id: vLLM's <id>-<prompt>
    assert [r.request_id for r in call.requests] == ["r-0", "r-1", "r-2"]
    one = completion(prompt="a")
    one.set_request_id("r")
    assert one.requests[0].request_id == "r"


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[1, "a"]]}, "prompt[0][1]"),
    ({"prompt": ["a", [-1]]}, "prompt[1][0]"),
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
])
def test_completion_prompts_that_are_not_prompts_are_named(body, param):
    with pytest.raises(InvalidArgument) as info:
        completion(**body)
    assert (info.value.reason, info.value.field) == ("INVALID_REQUEST", param)


def test_echo_is_taken_but_not_with_logprobs_which_would_need_the_prompts_logprobs():
    assert completion(prompt="x", echo=True).echo
    with pytest.raises(InvalidArgument) as info:
        completion(prompt="x", echo=True, logprobs=1)
    assert (info.value.reason, info.value.field) == ("UNSUPPORTED_PARAMETER", "echo")


@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'"x"', b'{"a": NaN}', b"\xff\xfe", b'{"a": "\xed\xa0\x80"}'])
def test_a_body_that_is_not_a_json_object_is_invalid_json(body):
    with pytest.raises(InvalidArgument) as info:
        parse_body(body)
    assert info.value.reason == "INVALID_JSON"


@pytest.mark.parametrize("body, field", [
    (b'{"a": [1, {"b": "[[[", "c\\"": ' + b"{\"d\": " * 63 + b"1" + b"}" * 63 + b"}]}", 'a[1].c"' + ".d" * 61),
    (b"[" * 65 + b"]" * 65, "[0]" * MAX_JSON_DEPTH),  # the 65th array is the first item of the 64th
    (b"[" * 100000, None),  # past the parser's recursion: refused before any value is made
])
def test_a_body_nested_past_the_limit_names_the_first_place_too_deep(body, field):
    """Named as the gateway names fields (strings are not nesting; a key is shown decoded), unless
    the parser itself gave up."""
    with pytest.raises(InvalidArgument) as info:
        parse_body(body)
    assert (info.value.reason, info.value.field) == ("JSON_TOO_DEEP", field)
