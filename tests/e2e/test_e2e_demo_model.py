"""End to end on tito-demo, the model tito trains itself: `tito serve render|engine|derender` as
processes on the native engine, greedy. It names the colour of images of sizes it never trained
on, thinks in a <think> block that derender splits into reasoning_content, calls the weather tool
in hermes markup that derender parses, answers from the tool's result, and `tito chat` prints all
of that distinctly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from google.protobuf import json_format

from tito_models import demo
from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, engine_pb2, render_pb2

from images import png
from service_processes import running_services

pytestmark = pytest.mark.e2e

#: (width, height) of the test images: none is a training size (demo.TRAIN_SIDES), one per colour.
UNTRAINED_SIZES = [(70, 50), (100, 100), (150, 90), (250, 200), (45, 45), (400, 300), (33, 120), (130, 60)]


@pytest.fixture(scope="module")
def services(demo_model, tmp_path_factory):
    with running_services(demo_model, tmp_path_factory.mktemp("demo-e2e")) as (addresses, _):
        yield addresses


def _png(colour: str, width: int, height: int) -> bytes:
    return png(demo.colour_image(colour, width, height, seed=width * 1000 + height))


def _chat(services, messages, *, thinking: bool = True, tools=(), max_tokens: int = 80) -> dict:
    request = render_pb2.RenderChatRequest(
        messages=messages, tools=[json_format.ParseDict(tool, chat_pb2.Tool()) for tool in tools],
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    if not thinking:
        request.chat_template_kwargs.update({"enable_thinking": False})
    with ChatPipeline(Endpoints(**services), timeout=120) as pipeline:
        chunks = list(pipeline.stream_chat(request))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for call in chunk.tool_calls:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.name
            entry["arguments"] += call.arguments
    return {"content": "".join(c.content for c in chunks),
            "reasoning": "".join(c.reasoning_content for c in chunks),
            "tool_calls": [calls[index] for index in sorted(calls)],
            "finish_reason": chunks[-1].finish_reason}


def _image_question(colour: str, width: int, height: int, text: str = "What colour is this?"):
    return chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=_png(colour, width, height))),
        chat_pb2.ContentPart(text=text)])


def test_every_colour_is_named_at_sizes_it_never_trained_on(services):
    assert not {side for size in UNTRAINED_SIZES for side in size} & set(demo.TRAIN_SIDES)
    answers = {}
    for colour, (width, height) in zip(sorted(demo.COLOURS), UNTRAINED_SIZES):
        answers[colour] = _chat(services, [_image_question(colour, width, height)], thinking=False)["content"]
    assert answers == {colour: f"The image is {colour}." for colour in demo.COLOURS}


def test_thinking_arrives_as_reasoning_and_the_answer_as_content(services):
    answer = _chat(services, [_image_question("blue", 90, 110)])
    assert answer["reasoning"].strip() == "The image is mostly blue."
    assert answer["content"].strip() == "The image is blue."
    assert "<think>" not in answer["content"] + answer["reasoning"]
    assert answer["finish_reason"] == engine_pb2.FINISH_REASON_STOP


def test_a_greeting_gets_a_short_sensible_answer(services):
    answer = _chat(services, [chat_pb2.ChatMessage(role="user", content="Hello! What can you do?")])
    assert answer["content"].strip() == demo.GREETING_ANSWER
    assert answer["reasoning"].strip()


def test_weather_question_calls_the_tool_then_answers_from_its_result(services):
    question = chat_pb2.ChatMessage(role="user", content="What is the weather in Tokyo?")
    first = _chat(services, [question], tools=[demo.WEATHER_TOOL])
    assert first["finish_reason"] == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert [call["name"] for call in first["tool_calls"]] == ["get_weather"]
    assert json.loads(first["tool_calls"][0]["arguments"]) == {"city": "Tokyo"}

    call = chat_pb2.ToolCall(id="call_1", type="function", function=chat_pb2.FunctionCall(
        name="get_weather", arguments=first["tool_calls"][0]["arguments"]))
    history = [question, chat_pb2.ChatMessage(role="assistant", content=first["content"], tool_calls=[call]),
               chat_pb2.ChatMessage(role="tool", tool_call_id="call_1",
                                    content=demo.weather_result("Tokyo", 17, "rainy"))]
    second = _chat(services, history, tools=[demo.WEATHER_TOOL])
    assert second["tool_calls"] == []
    assert second["content"].strip() == "It is rainy in Tokyo."


def test_tito_chat_prints_thinking_and_tool_calls_distinctly(services, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([demo.WEATHER_TOOL]))
    result = subprocess.run(
        [sys.executable, "-m", "tito_cli", "chat", "What is the weather in Paris?", "--tools", str(tools),
         "--render", services["render"], "--engine", services["engine"], "--derender", services["derender"]],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "thinking: The user asks about the weather in Paris. I will call get_weather."
    assert lines[1] == 'tool call: get_weather({"city": "Paris"})'
    assert lines[2].startswith("[finish_reason=FINISH_REASON_TOOL_CALLS ")


def test_quick_start_chat_answers_about_its_generated_image(demo_model, model_cache):
    """`tito chat "Hello! What can you do?"` as the README runs it: its own services, tito-demo, a red square."""
    env = dict(os.environ, TITO_CACHE_DIR=str(model_cache))  # the session's build, not a second one
    result = subprocess.run([sys.executable, "-m", "tito_cli", "chat", "Hello! What can you do?"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "red square" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "thinking: The user says hello and sends a red image."
    assert lines[1] == f"{demo.GREETING_ANSWER} Your image is red."
    assert lines[2].startswith("[finish_reason=FINISH_REASON_STOP ")
