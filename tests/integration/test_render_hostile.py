"""Hostile RenderChat inputs through a real render server (port 0): each is a documented caller
error (code, reason, field), never INTERNAL, and the server keeps serving the next request.

- numbers JSON cannot hold (NaN, Infinity) in any Struct the request takes;
- Structs nested past render's limit (`MAX_STRUCT_DEPTH`), and far past it (protobuf's own limit);
- a NUL byte in a `--media-dir` path;
- chat templates that would allocate without bound;
- media paths that cannot be served all answer alike (no existence oracle).
"""

from __future__ import annotations

import logging
import math

import grpc
import pytest
from google.protobuf import struct_pb2

from tito.errors import InvalidArgument
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, derender_pb2, render_pb2, render_pb2_grpc
from tito_render.config import RenderConfig
from tito_render.convert import messages_from_proto
from tito_render.media import loader
from tito.json_text import MAX_JSON_DEPTH
from tito_render.messages import MAX_STRUCT_DEPTH, messages_to_dicts
from tito_render.server import create_server

from images import noise_png

TIMEOUT = 30
IMAGE = "messages[0].content_parts[0].image"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def user(text: str = "What is the weather in Paris?") -> chat_pb2.ChatMessage:
    return chat_pb2.ChatMessage(role="user", content=text)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(noise_png(64, 64))
    (allowed / "folder").mkdir()
    (allowed / "locked.png").write_bytes(noise_png(64, 64))
    (root / "secret.png").write_bytes(noise_png(64, 64))
    (allowed / "escape.png").symlink_to(root / "secret.png")
    (allowed / "dangling.png").symlink_to(root / "gone.png")
    return allowed


@pytest.fixture(scope="module")
def text_stub(tiny_text_model, module_aio_server):
    server = module_aio_server(lambda: create_server(RenderConfig(model=str(tiny_text_model))))
    channel = server.channel()
    yield render_pb2_grpc.RenderServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def media_stub(tiny_vl_model, media_dir, module_aio_server):
    config = RenderConfig(model=str(tiny_vl_model), media_dir=str(media_dir))
    server = module_aio_server(lambda: create_server(config))
    channel = server.channel()
    yield render_pb2_grpc.RenderServiceStub(channel)
    channel.close()


def refused(stub, request: render_pb2.RenderChatRequest) -> dict:
    """RenderChat's error details for `request`, after which a good chat still renders."""
    with pytest.raises(grpc.RpcError) as err:
        stub.RenderChat(request, timeout=TIMEOUT)
    details = error_details(err.value)
    assert stub.RenderChat(render_pb2.RenderChatRequest(messages=[user()]), timeout=TIMEOUT).generate_request.token_ids
    return details


def struct(obj: dict) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(obj)
    return result


def nested_lists(levels: int) -> struct_pb2.Struct:
    """{"a": [[...[1]...]]}: the Struct plus `levels - 1` lists, `levels` containers in all.
    (Lists: a Struct level costs protobuf's decoder three message levels, a list two.)"""
    top = struct_pb2.Struct()
    value = top.fields["a"]
    for _ in range(levels - 1):
        value = value.list_value.values.add()
    value.number_value = 1
    return top


def tool(name: str, parameters: struct_pb2.Struct) -> chat_pb2.Tool:
    return chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name=name, parameters=parameters))


def chat_with_call(arguments: struct_pb2.Struct) -> list[chat_pb2.ChatMessage]:
    """An assistant message whose second tool call carries `arguments` as arguments_object."""
    return [user(), chat_pb2.ChatMessage(role="assistant", tool_calls=[
        chat_pb2.ToolCall(id="c0", function=chat_pb2.FunctionCall(name="f", arguments="{}")),
        chat_pb2.ToolCall(id="c1", function=chat_pb2.FunctionCall(name="f", arguments_object=arguments))])]


ARGUMENTS = "messages[1].tool_calls[1].function.arguments_object"


def struct_cases(bad: struct_pb2.Struct) -> dict[str, tuple[render_pb2.RenderChatRequest, str]]:
    """`bad` in each Struct field RenderChat takes on a text model, with that field's path."""
    return {
        "tool_parameters": (render_pb2.RenderChatRequest(messages=[user()],
                                                         tools=[tool("f", struct({})), tool("g", bad)]),
                            "tools[1].function.parameters"),
        "arguments_object": (render_pb2.RenderChatRequest(messages=chat_with_call(bad)), ARGUMENTS),
        "chat_template_kwargs": (render_pb2.RenderChatRequest(messages=[user()], chat_template_kwargs=bad),
                                 "chat_template_kwargs"),
    }


NON_FINITE = {f"{name}_{label}": case for label, number in (("nan", math.nan), ("inf", math.inf),
                                                          ("minus_inf", -math.inf))
              for name, case in struct_cases(struct({"type": "object", "x": {"min": [0, number]}})).items()}


@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_non_finite_numbers_in_structs_are_invalid_argument(text_stub, name):
    request, field = NON_FINITE[name]
    details = refused(text_stub, request)
    assert (details["code"], details["reason"], details["fields"]) == (INVALID, "NON_FINITE_NUMBER", [field]), details
    assert "x.min[1]" in details["message"], details


TOO_DEEP = struct_cases(nested_lists(MAX_STRUCT_DEPTH + 1))


@pytest.mark.parametrize("name", sorted(TOO_DEEP))
def test_structs_deeper_than_the_limit_are_refused(text_stub, name):
    request, field = TOO_DEEP[name]
    details = refused(text_stub, request)
    assert (details["code"], details["reason"], details["fields"]) == (INVALID, "STRUCT_TOO_DEEP", [field]), details
    assert str(MAX_STRUCT_DEPTH) in details["message"], details


@pytest.mark.parametrize("name", sorted(struct_cases(struct({}))))
def test_structs_at_the_limit_render(text_stub, name):
    request, _ = struct_cases(nested_lists(MAX_STRUCT_DEPTH))[name]
    assert text_stub.RenderChat(request, timeout=TIMEOUT).generate_request.token_ids


def nested_structs(levels: int) -> struct_pb2.Struct:
    """{"a": {"a": ... {"x": 1}}}: `levels` Structs."""
    top = struct_pb2.Struct()
    inner = top
    for _ in range(levels - 1):
        inner = inner.fields["a"].struct_value
    inner.fields["x"].number_value = 1
    return top


def test_tools_at_the_limit_still_reach_derender(text_stub):
    """The limit keeps what render copies into the DerenderContext (the tools) under protobuf's
    decoding limit where derender reads it, even for Structs nested in Structs (the costliest)."""
    response = text_stub.RenderChat(render_pb2.RenderChatRequest(
        messages=[user()], tools=[tool("f", nested_structs(MAX_STRUCT_DEPTH))]), timeout=TIMEOUT)
    wire = derender_pb2.DerenderRequest(context=response.derender_context).SerializeToString()
    context = derender_pb2.DerenderRequest.FromString(wire).context
    assert context.tools[0].function.parameters == nested_structs(MAX_STRUCT_DEPTH)


def test_processor_kwargs_are_checked_like_the_other_structs(media_stub):
    for bad, reason in ((struct({"resample": math.nan}), "NON_FINITE_NUMBER"),
                        (nested_lists(MAX_STRUCT_DEPTH + 1), "STRUCT_TOO_DEEP")):
        request = render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content_parts=[
                chat_pb2.ContentPart(image=chat_pb2.ImageSource(url="cat.png")), chat_pb2.ContentPart(text="hi")])],
            media_options=render_pb2.MediaOptions(processor_kwargs=bad))
        details = refused(media_stub, request)
        assert (details["code"], details["reason"], details["fields"]) == (
            INVALID, reason, ["media_options.processor_kwargs"]), details


def test_thousands_deep_arguments_are_refused(text_stub):
    """Far past the limit, protobuf's decoder (100 message levels) refuses the request before render
    sees it: still a caller error. In process, where no decoder stands in front, render's own
    limit refuses it before anything recurses."""
    request = render_pb2.RenderChatRequest(messages=[user()])
    function = request.messages.add(role="assistant").tool_calls.add().function
    function.name = "f"
    value = function.arguments_object.fields["a"]
    for _ in range(5000):  # built in place: copying a Struct this deep into a message re-parses it
        value = value.list_value.values.add()
    value.number_value = 1
    details = refused(text_stub, request)
    assert (details["code"], details["reason"]) == (INVALID, "MALFORMED_REQUEST"), details
    with pytest.raises(InvalidArgument) as err:
        messages_to_dicts(messages_from_proto(request.messages))
    assert (err.value.reason, err.value.field) == ("STRUCT_TOO_DEEP",
                                                   "messages[1].tool_calls[0].function.arguments_object")


def image_chat(url: str) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=url)), chat_pb2.ContentPart(text="What is this?")])])


@pytest.mark.parametrize("url", ["cat\0.png", "file:///etc/passwd%00.png", "\0"])
def test_nul_byte_in_a_media_path_is_invalid_argument(media_stub, url):
    details = refused(media_stub, image_chat(url))
    assert (details["code"], details["reason"], details["fields"]) == (
        INVALID, "INVALID_MEDIA_PATH", [f"{IMAGE}.url"]), details


def test_nul_byte_in_a_video_frame_path_names_the_frame(media_stub):
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(url="cat.png"),
                                                               chat_pb2.ImageSource(url="cat.png\0")], fps=2)),
        chat_pb2.ContentPart(text="What happens?")])])
    details = refused(media_stub, request)
    assert (details["code"], details["reason"], details["fields"]) == (
        INVALID, "INVALID_MEDIA_PATH", ["messages[0].content_parts[0].video.frames[1].url"]), details


UNSERVABLE = {  # name: (url, what the server log says about it)
    "missing": ("nope.png", "does not resolve"),
    "outside_dotdot": ("../secret.png", "outside"),
    "outside_absolute": ("file://{root}/secret.png", "outside"),
    "outside_missing": ("../nope.png", "does not resolve"),
    "symlink_escaping": ("escape.png", "outside"),
    "symlink_dangling": ("dangling.png", "does not resolve"),
    "directory": ("folder", "not a regular file"),
    "media_dir_itself": (".", "not a regular file"),
    "unreadable": ("locked.png", "cannot be read"),
    "file_url_missing": ("file:///nope/cat.png", "does not resolve"),
}


@pytest.mark.parametrize("name", sorted(UNSERVABLE))
def test_unservable_media_paths_all_answer_alike(media_stub, media_dir, name, caplog, monkeypatch):
    url, cause = UNSERVABLE[name]
    url = url.format(root=media_dir.parent)
    if name == "unreadable":  # as root, chmod 0 does not stop a read: make open() refuse instead
        def refuse(path, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(path))
        monkeypatch.setattr(loader, "open", refuse, raising=False)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        details = refused(media_stub, image_chat(url))
    assert (details["code"], details["reason"], details["fields"]) == (
        INVALID, "MEDIA_NOT_FOUND", [f"{IMAGE}.url"]), details
    assert details["message"] == loader.MEDIA_NOT_FOUND_MESSAGE, details
    logged = [record.getMessage() for record in caplog.records if record.name == loader.__name__]
    assert any(url.removeprefix("file://") in line and cause in line for line in logged), logged


# Sizes chosen so that, were a bound missing, the test fails fast instead of taking the machine's
# memory: each value is either cheap to build or past any address space (MemoryError at once), and
# output past the bound ends in raise_exception rather than in tokenizing 100 MB.
BOUNDED_TEMPLATES = {
    "string_repetition": "{{ 'x' * 10**15 }}",
    "list_repetition": "{{ ([1] * 10**15) | length }}",
    "huge_power": "{{ 7 ** 100000 }}",
    "int_squaring": "{% set ns = namespace(x=3) %}{% for i in range(20) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "huge_range": "{% for i in range(10**15) %}x{% endfor %}",
    "output_growth": "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}{{ raise_exception('unbounded') }}",
    "macro_output_growth": "{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}"
                           "{% set s = m() %}{{ raise_exception('unbounded') }}",
}
UNBOUNDED_TEMPLATES = {  # not bounded by the sandbox: the MemoryError the allocation raises is mapped
    "padding": "{{ '%999999999999999s' % 'x' }}",
    "ljust": "{{ 'x'.ljust(10**15) }}",
}


@pytest.mark.parametrize("name", sorted(BOUNDED_TEMPLATES) + sorted(UNBOUNDED_TEMPLATES))
def test_templates_that_would_allocate_without_bound_are_refused(text_stub, name):
    template = BOUNDED_TEMPLATES.get(name) or UNBOUNDED_TEMPLATES[name]
    details = refused(text_stub, render_pb2.RenderChatRequest(messages=[user()], chat_template=template))
    assert details["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert (details["reason"], details["fields"]) == ("TEMPLATE_TOO_LARGE", ["chat_template"]), details
    # Bounded ones are refused before allocating, naming the bound (not by running out of memory).
    assert ("over the limit max_template_" in details["message"]) == (name in BOUNDED_TEMPLATES), details


def test_ordinary_template_arithmetic_still_works(text_stub):
    template = ("{{ '=' * 80 }}{{ 2 ** 64 }}{% for m in messages %}{{ ' ' * loop.index }}{{ m.content }}"
                "{% endfor %}{{ ([0] * 3) | length }}{% for i in range(1000) %}.{% endfor %}")
    response = text_stub.RenderChat(render_pb2.RenderChatRequest(
        messages=[user()], chat_template=template, return_prompt_text=True), timeout=TIMEOUT)
    assert response.prompt_text == ("=" * 80 + str(2 ** 64) + " What is the weather in Paris?" + "3" + "." * 1000)


def test_a_request_has_one_pixel_budget_across_its_images(tiny_vl_model, aio_server):
    """Each 64x64 image is within --max-image-pixels, but three of them exceed the request's budget:
    refused at the image that crosses it, from its header, before its pixels are decoded."""
    # No processed-image cache: a cached image is not decoded again, so it spends nothing.
    config = RenderConfig(model=str(tiny_vl_model), max_request_pixels=3 * 64 * 64 - 1, media_cache_mb=0)
    server = aio_server(lambda: create_server(config))
    images = [chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(64, 64, seed))) for seed in range(3)]
    with server.channel() as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        two = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[*images[:2], chat_pb2.ContentPart(text="Compare them")])])
        assert stub.RenderChat(two, timeout=TIMEOUT).generate_request.mm_features.items
        three = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[*images, chat_pb2.ContentPart(text="Compare them")])])
        details = refused(stub, three)
    assert (details["code"], details["reason"]) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "REQUEST_TOO_MANY_PIXELS")
    assert details["fields"] == ["messages[0].content_parts[2].image.data"]


def deep_json(levels: int, kind: str) -> str:
    """JSON text nested `levels` containers deep: lists (`[[[...]]]`) or objects (`{"a": {...}}`)."""
    if kind == "list":
        return "[" * levels + "]" * levels
    return '{"a": ' * levels + "1" + "}" * levels


def arguments_chat(arguments: str) -> render_pb2.RenderChatRequest:
    request = render_pb2.RenderChatRequest(messages=[user()])
    call = request.messages.add(role="assistant").tool_calls.add()
    call.function.name = "f"
    call.function.arguments = arguments
    request.messages.add(role="tool", content="ok", tool_call_id="c0")
    return request


@pytest.mark.parametrize("levels,kind", [(100_000, "list"), (5_000, "object"), (MAX_JSON_DEPTH + 1, "object"),
                                         (100_000, "object")])
def test_deep_json_arguments_are_refused(text_stub, levels, kind):
    """A tool call's `arguments` text nested past MAX_JSON_DEPTH: the contract's JSON_TOO_DEEP,
    checked before anything parses it (json.loads recurses), and render keeps serving."""
    text = deep_json(levels, kind)
    if kind == "object" and levels <= MAX_JSON_DEPTH + 1:
        text = '{"x": ' + deep_json(levels - 1, kind) + "}"
    details = refused(text_stub, arguments_chat(text))
    assert (details["code"], details["reason"], details["fields"]) == (
        INVALID, "JSON_TOO_DEEP", ["messages[1].tool_calls[0].function.arguments"]), details
    assert str(MAX_JSON_DEPTH) in details["message"]


def test_arguments_at_the_json_depth_limit_render(text_stub):
    text = deep_json(MAX_JSON_DEPTH, "object")
    response = text_stub.RenderChat(arguments_chat(text), timeout=TIMEOUT)
    assert response.generate_request.token_ids


@pytest.mark.parametrize("field,make", [
    ("sampling.structured_output.json_schema",
     lambda text: render_pb2.SamplingOptions(structured_output={"json_schema": text})),
    ("sampling.structured_output.structural_tag",
     lambda text: render_pb2.SamplingOptions(structured_output={"structural_tag": text})),
])
@pytest.mark.parametrize("levels,kind", [(100_000, "list"), (5_000, "object")])
def test_deep_json_constraints_are_refused(text_stub, field, make, levels, kind):
    request = render_pb2.RenderChatRequest(messages=[user()], sampling=make(deep_json(levels, kind)))
    details = refused(text_stub, request)
    assert (details["code"], details["reason"], details["fields"]) == (INVALID, "JSON_TOO_DEEP", [field]), details


@pytest.mark.parametrize("levels", [MAX_STRUCT_DEPTH + 1, 5_000])
def test_deep_response_format_and_tool_schemas_are_refused(text_stub, levels):
    """response_format schemas and tool parameter schemas are Structs: past MAX_STRUCT_DEPTH,
    STRUCT_TOO_DEEP in render, or protobuf's own limit (MALFORMED_REQUEST) far past it."""
    schema = nested_lists(levels)
    expected = "STRUCT_TOO_DEEP" if levels == MAX_STRUCT_DEPTH + 1 else "MALFORMED_REQUEST"
    as_format = render_pb2.RenderChatRequest(messages=[user()], response_format=render_pb2.ResponseFormat(
        type="json_schema", json_schema=render_pb2.JsonSchemaResponseFormat(name="x")))
    as_format.response_format.json_schema.schema.CopyFrom(schema) if levels < 100 else _deep_into(
        as_format.response_format.json_schema.schema, levels)
    as_tool = render_pb2.RenderChatRequest(messages=[user()])
    parameters = as_tool.tools.add(type="function").function
    parameters.name = "f"
    parameters.parameters.CopyFrom(schema) if levels < 100 else _deep_into(parameters.parameters, levels)
    for request, field in ((as_format, "response_format.json_schema.schema"),
                           (as_tool, "tools[0].function.parameters")):
        details = refused(text_stub, request)
        assert (details["code"], details["reason"]) == (INVALID, expected), details
        if expected == "STRUCT_TOO_DEEP":
            assert details["fields"] == [field], details


def _deep_into(struct: struct_pb2.Struct, levels: int) -> None:
    value = struct.fields["a"]
    for _ in range(levels - 1):  # built in place: copying a Struct this deep re-parses it
        value = value.list_value.values.add()
    value.number_value = 1
