"""tito-demo: the build is deterministic, its name resolves, and training saw exactly the token ids
render sends for the same chats (template, tools, image placeholders)."""

from __future__ import annotations

import hashlib
import json

import pytest
from google.protobuf import json_format

from tito_models import demo
from tito_models.paths import TINY_MODELS, resolve_model
from tito.v1 import chat_pb2, render_pb2
from tito_render.convert import chat_response

from images import png


def _file_hashes(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def test_two_builds_write_identical_bytes(demo_model, demo_rebuild):
    again = demo_rebuild
    assert _file_hashes(again) == _file_hashes(demo_model)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "preprocessor_config.json", "generation_config.json", "model.safetensors"} <= set(_file_hashes(again))


def test_the_name_resolves_to_the_cached_build(demo_model, model_cache):
    assert demo.DEMO_MODEL in TINY_MODELS
    assert demo_model.name == f"{demo.DEMO_MODEL}-{demo.VERSION}"
    assert resolve_model(demo.DEMO_MODEL, model_cache) == demo_model


def _proto_message(message: dict, image_png: bytes | None) -> chat_pb2.ChatMessage:
    content = message.get("content")
    fields = {key: value for key, value in message.items() if key not in ("content", "tool_calls")}
    proto = chat_pb2.ChatMessage(**fields)
    if isinstance(content, list):
        for part in content:
            if part["type"] == "image":
                proto.content_parts.add(image=chat_pb2.ImageSource(data=image_png))
            else:
                proto.content_parts.add(text=part["text"])
    elif content is not None:
        proto.content = content
    for call in message.get("tool_calls", ()):
        proto.tool_calls.add(id=call["id"], type="function", function=chat_pb2.FunctionCall(
            name=call["function"]["name"], arguments=call["function"]["arguments"]))
    return proto


def _render_request(chat: demo.Conversation) -> render_pb2.RenderChatRequest:
    image = png(demo.colour_image(*chat.image)) if chat.image else None
    request = render_pb2.RenderChatRequest(messages=[_proto_message(m, image) for m in chat.messages],
                                           tools=[json_format.ParseDict(t, chat_pb2.Tool()) for t in chat.tools])
    if not chat.thinking:
        request.chat_template_kwargs.update({"enable_thinking": False})
    return request


@pytest.fixture(scope="module")
def renderer(demo_model):
    from tito_render.config import RenderConfig
    from tito_render.model import load_render_model
    from tito_render.renderer import Renderer

    return Renderer(load_render_model(RenderConfig(model=str(demo_model))))


def test_training_ids_are_the_ids_render_sends(renderer):
    from transformers import AutoImageProcessor

    model = renderer.model
    image_processor = AutoImageProcessor.from_pretrained(str(model.path), backend="pil")  # render's backend
    chats = demo.conversations(60, seed=7)
    kinds = {(bool(c.image), bool(c.tools), len(c.messages), c.thinking) for c in chats}
    assert len(kinds) >= 6  # images, tools, tool-result turns, thinking on and off
    for chat in chats:
        example = demo.encode(chat, model.tokenizer, image_processor)
        rendered = chat_response(renderer, _render_request(chat))
        assert list(rendered.generate_request.token_ids) == example.token_ids[:example.prompt_length]
    assert model.reasoning_parser == "qwen3" and model.tool_parser == "hermes"


def test_the_weather_tool_example_file_is_the_trained_tool():
    from pathlib import Path

    example = Path(__file__).parents[3] / "docs" / "examples" / "weather_tool.json"
    assert json.loads(example.read_text()) == [demo.WEATHER_TOOL]
