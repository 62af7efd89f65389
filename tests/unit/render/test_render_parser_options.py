"""Render chooses what the named parsers need: a tool parser whose markup is special tokens
(Mistral's [TOOL_CALLS]) gets skip_special_tokens false by default for the requests it parses;
and the tiny model's generation_config (do_sample false) makes an unset temperature greedy."""

from __future__ import annotations

import pytest

from tito.v1 import chat_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.convert import chat_response


@pytest.fixture(scope="module")
def renderers(tiny_text_model) -> dict[str, Renderer]:
    return {parser: Renderer(load_render_model(RenderConfig(model=str(tiny_text_model), tool_parser=parser)))
            for parser in ("mistral", "hermes")}


def chat(tools: bool = True, **sampling) -> render_pb2.RenderChatRequest:
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="Weather?")])
    if tools:
        request.tools.add(type="function", function=chat_pb2.FunctionDefinition(name="get_weather"))
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


# (tool parser, tools offered, tool_choice, request's skip_special_tokens, resolved skip_special_tokens)
CASES = [
    ("mistral", True, None, None, False),
    ("mistral", True, chat_pb2.TOOL_CHOICE_MODE_REQUIRED, None, False),
    ("mistral", True, chat_pb2.TOOL_CHOICE_MODE_NONE, None, True),  # no parsing: nothing needs them
    ("mistral", False, None, None, True),
    ("mistral", True, None, True, True),  # the request's own choice wins
    ("hermes", True, None, None, True),
    ("hermes", True, None, False, False),
]


@pytest.mark.parametrize("parser,tools,mode,requested,expected", CASES)
def test_skip_special_tokens_follows_the_tool_parser(renderers, parser, tools, mode, requested, expected):
    request = chat(tools)
    if mode is not None:
        request.tool_choice.mode = mode
    if requested is not None:
        request.sampling.skip_special_tokens = requested
    response = chat_response(renderers[parser], request)
    assert response.derender_context.tool_parser == parser
    assert response.derender_context.text_options.skip_special_tokens is expected
    assert response.generate_request.sampling_params.text_options.skip_special_tokens is expected


def test_the_tiny_models_do_sample_false_is_greedy_unless_the_request_samples(renderers):
    renderer = renderers["hermes"]
    assert renderer.model.generation_defaults == {"do_sample": False}
    def temperature(**sampling) -> float:
        return chat_response(renderer, chat(**sampling)).generate_request.sampling_params.temperature

    assert temperature() == 0.0
    assert temperature(temperature=0.8) == pytest.approx(0.8)
    assert temperature(top_p=0.9) == 1.0
