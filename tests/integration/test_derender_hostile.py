"""DerenderService against hostile but decodable requests, over real gRPC (port 0).

Every case is answered as a documented caller error (code, reason, field) or handled as the
contract says (model output that is not a usable tool call degrades to content), never INTERNAL;
after each one the same server still derenders a good stream.
"""

from __future__ import annotations

import json

import grpc
import pytest

from tito.contract import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, sampling_pb2
from tito_derender.config import DerenderConfig
from tito_derender.parsers.tools.json_scan import MAX_DEPTH
from tito_derender.server import create_server

DEADLINE = 20
UINT32_MAX = 2**32 - 1
STOP = engine_pb2.FINISH_REASON_STOP
DEEP = 100_000  # far past Python's recursion limit


@pytest.fixture(scope="module")
def server(module_aio_server, tiny_text_model):
    return module_aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))


@pytest.fixture(scope="module")
def stub(server):
    channel = server.channel()
    yield derender_pb2_grpc.DerenderServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


def context(**fields) -> derender_pb2.DerenderRequest:
    return derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext(**fields))


def engine(**fields) -> derender_pb2.DerenderRequest:
    return derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(**fields))


def tools(*names: str) -> list[chat_pb2.Tool]:
    return [chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name=name)) for name in names]


def derender(stub, requests) -> list[derender_pb2.ChatChunk]:
    return [reply.chunk for reply in stub.Derender(iter(requests), timeout=DEADLINE)]


def refused(call) -> dict:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error_details(error.value)


def stream_refused(stub, requests) -> dict:
    return refused(lambda: derender(stub, requests))


def assert_refusal(details: dict, code: grpc.StatusCode, reason: str, field: str | None) -> None:
    assert details["code"] == code, details
    assert details["reason"] == reason, details
    if field is not None:
        assert details["fields"][:1] == [field], details


def assert_still_works(stub, tokenizer) -> None:
    """A good stream right after: the server (and its event loop) is unharmed."""
    ids = tokenizer.encode("still fine", add_special_tokens=False)
    chunks = derender(stub, [context(prompt_tokens=3), engine(index=0, token_ids=ids, finish_reason=STOP,
                                                              usage=engine_pb2.Usage(completion_tokens=len(ids)))])
    assert "".join(c.content for c in chunks) == "still fine"
    assert chunks[-1].finish_reason == STOP and chunks[-1].usage.completion_tokens == len(ids)


# ---------------------------------------------------------------- 1. usage counts

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_usage_summed_over_choices_past_uint32_is_refused_not_internal(stub, tokenizer):
    # Each choice claims 2**32-1 completion tokens for 1 streamed: the sum over choices would not
    # fit ChatChunk.usage (uint32). The first claim is already a lie, refused when it arrives.
    huge = engine_pb2.Usage(completion_tokens=UINT32_MAX)
    requests = [context(n=2),
                engine(index=0, token_ids=[5], finish_reason=STOP, usage=huge),
                engine(index=1, token_ids=[5], finish_reason=STOP, usage=huge)]
    assert_refusal(stream_refused(stub, requests), INVALID, "USAGE_OUT_OF_RANGE",
                   "generate_response.usage.completion_tokens")
    assert_still_works(stub, tokenizer)


def test_usage_completion_more_than_streamed_is_refused(stub, tokenizer):
    requests = [context(), engine(index=0, token_ids=[5, 6]),
                engine(index=0, token_ids=[7], finish_reason=STOP, usage=engine_pb2.Usage(completion_tokens=4))]
    details = stream_refused(stub, requests)
    assert_refusal(details, INVALID, "USAGE_OUT_OF_RANGE", "generate_response.usage.completion_tokens")
    assert "3" in details["message"]  # says how many were streamed
    assert_still_works(stub, tokenizer)


def test_usage_cached_more_than_prompt_is_refused(stub, tokenizer):
    requests = [context(prompt_tokens=10),
                engine(index=0, token_ids=[5], finish_reason=STOP,
                       usage=engine_pb2.Usage(prompt_tokens=UINT32_MAX - 1, completion_tokens=1,
                                              cached_tokens=UINT32_MAX))]
    assert_refusal(stream_refused(stub, requests), INVALID, "USAGE_OUT_OF_RANGE",
                   "generate_response.usage.cached_tokens")
    assert_still_works(stub, tokenizer)


def test_usage_at_the_uint32_edge_that_is_consistent_passes(stub):
    # Counts that agree with the stream are taken as they are, however large the prompt.
    chunks = derender(stub, [context(n=2),
                             engine(index=0, token_ids=[5, 6], finish_reason=STOP, usage=engine_pb2.Usage(
                                 prompt_tokens=UINT32_MAX, completion_tokens=2, cached_tokens=UINT32_MAX)),
                             engine(index=1, token_ids=[5], finish_reason=STOP, usage=engine_pb2.Usage(
                                 prompt_tokens=UINT32_MAX, completion_tokens=1, cached_tokens=7))])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (UINT32_MAX, 3, UINT32_MAX)


def test_usage_after_a_stop_string_is_not_checked_against_ignored_tokens(stub, tokenizer):
    # Derender ends the choice on the stop string; the engine's later messages (and its final
    # count, which includes tokens derender ignored) are ignored, not refused.
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    requests = [context(text_options=sampling_pb2.OutputTextOptions(stop=["two"])),
                engine(index=0, token_ids=ids),
                engine(index=0, token_ids=[5, 6, 7], finish_reason=STOP,
                       usage=engine_pb2.Usage(completion_tokens=len(ids) + 3))]
    chunks = derender(stub, requests)
    assert "".join(c.content for c in chunks) == "one "
    assert chunks[-1].matched_stop == "two" and chunks[-1].usage.completion_tokens == len(ids)


def test_derender_full_usage_refusal_names_the_response(stub, tokenizer):
    request = derender_pb2.DerenderFullRequest(
        context=derender_pb2.DerenderContext(n=2),
        responses=[engine_pb2.GenerateResponse(index=0, token_ids=[5], finish_reason=STOP,
                                               usage=engine_pb2.Usage(completion_tokens=1)),
                   engine_pb2.GenerateResponse(index=1, token_ids=[5], finish_reason=STOP,
                                               usage=engine_pb2.Usage(completion_tokens=UINT32_MAX))])
    assert_refusal(refused(lambda: stub.DerenderFull(request, timeout=DEADLINE)), INVALID, "USAGE_OUT_OF_RANGE",
                   "responses[1].usage.completion_tokens")
    assert_still_works(stub, tokenizer)


# ---------------------------------------------------------------- 2. enum values out of range

def test_unknown_finish_reason_is_refused(stub, tokenizer):
    details = stream_refused(stub, [context(), engine(index=0, token_ids=[5], finish_reason=99)])
    assert_refusal(details, INVALID, "INVALID_FINISH_REASON", "generate_response.finish_reason")
    assert "99" in details["message"]
    details = refused(lambda: stub.DerenderFull(derender_pb2.DerenderFullRequest(
        responses=[engine_pb2.GenerateResponse(index=0, finish_reason=2**31 - 1)]), timeout=DEADLINE))
    assert_refusal(details, INVALID, "INVALID_FINISH_REASON", "responses[0].finish_reason")
    # TOOL_CALLS is a known value, but derender's to set.
    details = stream_refused(stub, [context(), engine(index=0, finish_reason=engine_pb2.FINISH_REASON_TOOL_CALLS)])
    assert_refusal(details, INVALID, "INVALID_FINISH_REASON", "generate_response.finish_reason")
    assert_still_works(stub, tokenizer)


def test_unknown_tool_choice_mode_is_refused(stub, tokenizer):
    for mode in (99, -5):
        details = stream_refused(stub, [context(tools=tools("f"), tool_parser="hermes",
                                                tool_choice=chat_pb2.ToolChoice(mode=mode))])
        assert_refusal(details, INVALID, "INVALID_TOOL_CHOICE", "context.tool_choice.mode")
    assert_still_works(stub, tokenizer)


def test_tool_choice_naming_a_function_not_among_the_tools_is_refused(stub, tokenizer):
    """As render refuses it (UNKNOWN_TOOL on tool_choice.function_name), in both RPCs."""
    ctx = derender_pb2.DerenderContext(tools=tools("f", "g"), tool_parser="hermes",
                                       tool_choice=chat_pb2.ToolChoice(function_name="h"))
    details = stream_refused(stub, [derender_pb2.DerenderRequest(context=ctx)])
    assert_refusal(details, INVALID, "UNKNOWN_TOOL", "context.tool_choice.function_name")
    assert "'h'" in details["message"] and "'f'" in details["message"]
    details = refused(lambda: stub.DerenderFull(derender_pb2.DerenderFullRequest(context=ctx), timeout=DEADLINE))
    assert_refusal(details, INVALID, "UNKNOWN_TOOL", "context.tool_choice.function_name")
    named = derender_pb2.DerenderContext(tools=tools("f"), tool_parser="hermes",
                                         tool_choice=chat_pb2.ToolChoice(function_name="f"))
    ids = tokenizer.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>', add_special_tokens=False)
    chunks = derender(stub, [derender_pb2.DerenderRequest(context=named), engine(index=0, token_ids=ids,
                                                                                 finish_reason=STOP)])
    assert [d.name for c in chunks for d in c.tool_calls if d.name] == ["f"]
    assert_still_works(stub, tokenizer)


@pytest.mark.parametrize("stops,field", [
    (["s"] * (MAX_STOP_STRINGS + 1), "context.text_options.stop"),
    (["ok", "x" * (MAX_STOP_STRING_CHARS + 1)], "context.text_options.stop[1]"),
    (["x"] * 100_000, "context.text_options.stop"),
])
def test_stop_strings_past_their_bound_are_refused(stub, tokenizer, stops, field):
    ctx = context(text_options=sampling_pb2.OutputTextOptions(stop=stops))
    details = stream_refused(stub, [ctx])
    assert_refusal(details, INVALID, "STOP_STRINGS_TOO_LARGE", field)
    assert str(MAX_STOP_STRINGS if field.endswith("stop") else MAX_STOP_STRING_CHARS) in details["message"]
    assert_still_works(stub, tokenizer)


def test_stop_strings_at_their_bound_are_accepted(stub, tokenizer):
    stops = ["zz" + str(i) for i in range(MAX_STOP_STRINGS - 1)] + ["fine"]
    ids = tokenizer.encode("still fine here", add_special_tokens=False)
    chunks = derender(stub, [context(text_options=sampling_pb2.OutputTextOptions(stop=stops)),
                             engine(index=0, token_ids=ids, finish_reason=STOP)])
    assert "".join(c.content for c in chunks) == "still " and chunks[-1].matched_stop == "fine"
    long_stop = "q" * MAX_STOP_STRING_CHARS
    chunks = derender(stub, [context(text_options=sampling_pb2.OutputTextOptions(stop=[long_stop])),
                             engine(index=0, token_ids=ids, finish_reason=STOP)])
    assert "".join(c.content for c in chunks) == "still fine here"


# ---------------------------------------------------------------- 3. tool calls nested too deep

DEEP_CALLS = {
    # arguments as a JSON string holding the deep value: json.loads used to raise RecursionError
    "hermes-string": ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * DEEP + '"}</tool_call>'),
    "hermes-object": ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP
                      + "}}</tool_call>"),
    "llama3_json-string": ("llama3_json", '{"name": "f", "parameters": "' + '{\\"a\\":' * (DEEP // 4) + '"}'),
    "mistral-string": ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": "' + "[" * DEEP + '"}]'),
    "pythonic": ("pythonic", "[f(a=" + "[" * DEEP + "]" * DEEP + ")]"),
}


def _tool_context(parser: str) -> derender_pb2.DerenderContext:
    return derender_pb2.DerenderContext(tools=tools("f"), tool_parser=parser,
                                        text_options=sampling_pb2.OutputTextOptions(skip_special_tokens=False))


@pytest.mark.parametrize("case", sorted(DEEP_CALLS))
def test_deeply_nested_tool_call_is_content_in_derender_full(stub, tokenizer, case):
    parser, text = DEEP_CALLS[case]
    ids = tokenizer.encode(text, add_special_tokens=False)
    response = stub.DerenderFull(derender_pb2.DerenderFullRequest(
        context=_tool_context(parser),
        responses=[engine_pb2.GenerateResponse(index=0, token_ids=ids, finish_reason=STOP)]), timeout=DEADLINE)
    [choice] = response.choices
    assert not choice.message.tool_calls and choice.message.content == text  # malformed call: the model's text
    assert choice.finish_reason == STOP
    assert_still_works(stub, tokenizer)


@pytest.mark.parametrize("case", sorted(DEEP_CALLS))
def test_deeply_nested_tool_call_degrades_in_a_stream(stub, tokenizer, case):
    parser, text = DEEP_CALLS[case]
    ids = tokenizer.encode(text, add_special_tokens=False)
    requests = [derender_pb2.DerenderRequest(context=_tool_context(parser))]
    requests += [engine(index=0, token_ids=ids[i:i + 64]) for i in range(0, len(ids), 64)]
    requests.append(engine(index=0, finish_reason=STOP))
    chunks = derender(stub, requests)
    deltas = [d for c in chunks for d in c.tool_calls]
    if deltas:  # the name streamed before the nesting went too deep: arguments closed, valid JSON
        assert [d.name for d in deltas if d.name] == ["f"]
        arguments = "".join(d.arguments for d in deltas)
        assert isinstance(json.loads(arguments), dict)
        assert arguments.count("[") <= MAX_DEPTH
    else:
        assert "".join(c.content for c in chunks) == text
    assert chunks[-1].finish_reason in (STOP, engine_pb2.FINISH_REASON_TOOL_CALLS)
    assert_still_works(stub, tokenizer)


def test_nesting_within_the_bound_is_still_a_call(stub, tokenizer):
    depth = MAX_DEPTH - 3  # the call object, the arguments object and "a"'s list fit
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(arguments) + "}</tool_call>"
    response = stub.DerenderFull(derender_pb2.DerenderFullRequest(
        context=_tool_context("hermes"),
        responses=[engine_pb2.GenerateResponse(index=0, token_ids=tokenizer.encode(text, add_special_tokens=False),
                                               finish_reason=STOP)]), timeout=DEADLINE)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "f" and call.function.arguments == arguments


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\udfff\\"}"}</tool_call>'),
], ids=["name", "string-arguments"])
def test_lone_surrogate_escapes_make_a_call_malformed(stub, tokenizer, parser, text):
    # JSON "\ud800" decodes to a lone surrogate, which no protobuf string can carry.
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = derender(stub, [derender_pb2.DerenderRequest(context=_tool_context(parser)),
                             engine(index=0, token_ids=ids, finish_reason=STOP)])
    assert not any(c.tool_calls for c in chunks)
    assert "".join(c.content for c in chunks) == text


def test_pythonic_surrogate_escapes_become_json_escapes(stub, tokenizer):
    text = '[f(a="\\ud83c\\udf89", b="\\ud800")]'
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = derender(stub, [derender_pb2.DerenderRequest(context=_tool_context("pythonic")),
                             engine(index=0, token_ids=ids, finish_reason=STOP)])
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "f"
    assert json.loads("".join(d.arguments for d in deltas)) == {"a": "🎉", "b": "\ud800"}


# ---------------------------------------------------------------- 4. huge caller strings in messages

@pytest.mark.parametrize("field", ["tool_parser", "reasoning_parser"])
def test_huge_parser_name_is_not_echoed_in_full(stub, tokenizer, field):
    details = stream_refused(stub, [context(**{field: "x" * 100_000})])
    assert_refusal(details, INVALID, "UNKNOWN_PARSER", f"context.{field}")
    assert len(details["message"]) < 300 and "xxxx..." in details["message"].replace("'", "")
    assert "100000 characters" in details["message"]
    assert_still_works(stub, tokenizer)


# ---------------------------------------------------------------- other malformed streams

MALFORMED_STREAMS = [
    ("engine response first", [engine(index=0, token_ids=[5])], INVALID, "CONTEXT_REQUIRED", "context"),
    ("empty message first", [derender_pb2.DerenderRequest()], INVALID, "CONTEXT_REQUIRED", "context"),
    ("two contexts", [context(), context()], INVALID, "UNEXPECTED_CONTEXT", "context"),
    ("empty message later", [context(), derender_pb2.DerenderRequest()], INVALID, "EMPTY_MESSAGE",
     "generate_response"),
    ("tail id past the vocabulary", [context(prompt_tail_token_ids=[UINT32_MAX])], INVALID,
     "TOKEN_ID_OUT_OF_RANGE", "context.prompt_tail_token_ids[0]"),
    ("n = 2**32-1", [context(n=UINT32_MAX)], INVALID, "TOO_MANY_CHOICES", "context.n"),
    ("index = 2**32-1", [context(), engine(index=UINT32_MAX)], INVALID, "CHOICE_INDEX_OUT_OF_RANGE",
     "generate_response.index"),
    ("token id = 2**32-1", [context(), engine(index=0, token_ids=[5, UINT32_MAX])], INVALID,
     "TOKEN_ID_OUT_OF_RANGE", "generate_response.token_ids[1]"),
    ("stop token id = 2**32-1", [context(), engine(index=0, finish_reason=STOP, matched_stop_token_id=UINT32_MAX)],
     INVALID, "TOKEN_ID_OUT_OF_RANGE", "generate_response.matched_stop_token_id"),
    ("logprob token id = 2**32-1", [context(), engine(index=0, token_ids=[5], logprobs=[engine_pb2.PositionLogprobs(
        sampled=engine_pb2.TokenLogprob(token_id=UINT32_MAX))])], INVALID, "TOKEN_ID_OUT_OF_RANGE",
     "generate_response.logprobs[0].sampled.token_id"),
    ("message after the final one", [context(), engine(index=0, finish_reason=STOP), engine(index=0)],
     grpc.StatusCode.FAILED_PRECONDITION, "CHOICE_ALREADY_FINISHED", "generate_response.index"),
]


@pytest.mark.parametrize("case,requests,code,reason,field", MALFORMED_STREAMS,
                         ids=[case[0] for case in MALFORMED_STREAMS])
def test_malformed_stream_is_a_caller_error(stub, tokenizer, case, requests, code, reason, field):
    assert_refusal(stream_refused(stub, requests), code, reason, field)
    assert_still_works(stub, tokenizer)


def test_empty_and_context_only_streams_end_quietly(stub, tokenizer):
    assert derender(stub, []) == []
    assert derender(stub, [context(n=3)]) == []
    assert_still_works(stub, tokenizer)


def test_huge_prompt_tail_is_accepted_and_cheap(stub, tokenizer):
    tail = tokenizer.encode("words " * 20_000, add_special_tokens=False)
    garbage = tokenizer.encode("🎉", add_special_tokens=False)[:1] * 200  # bytes that never complete
    chunks = derender(stub, [context(prompt_tail_token_ids=tail), engine(index=0, token_ids=garbage),
                             engine(index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH)])
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert_still_works(stub, tokenizer)
