"""The model families with their own markup (Qwen3-Coder, DeepSeek-V3.1, Kimi-K2, GLM-4.5,
gpt-oss), with offline tokenizers carrying each family's real special tokens and real chat
template: render detects the family's parsers, renders a chat with tools, a tool-call turn (with
reasoning where the family renders it) and a tool result to exactly the text the stored template
gives when rendered on its own with plain jinja2, and an assistant turn rendered by the template
parses back (derender) into the same tool calls, reasoning and content."""

from __future__ import annotations

import copy
import datetime
import json

import pytest
from google.protobuf import struct_pb2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from family_tokenizers import ensure_family_tokenizer
from tito.v1 import chat_pb2, render_pb2
from tito_derender.convert import context_from_proto
from tito_derender.domain import EngineOutput, FinishReason
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer
from tito_render.config import RenderConfig
from tito_render.model import detect_parsers
from tito_render.templates import chat_template
from tito_render.convert import chat_response
from hf_reference import hf_of
from renderers import load_renderer

# gpt-oss's template prints every parameter's description: give each one.
PARAMS = {"properties": {"city": {"description": "City name", "type": "string"},
                         "days": {"description": "Days ahead", "type": "integer"}},
          "required": ["city"], "type": "object"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                         "parameters": PARAMS}}
ARGS = {"city": "Paris", "days": 3}

# family -> (reasoning parser, tool parser, skip_special_tokens default, call id, assistant turn)
FAMILIES = {
    "qwen3_coder": ("qwen3", "qwen3_coder", True, "call_1", {"content": "Let me check."}),
    # A tool-call turn with content null, as an OpenAI client sends it (DeepSeek's templates test it).
    "deepseek_r1": ("deepseek_r1", "deepseek_v3", True, "call_1",
                    {"content": None, "reasoning_content": "Need the weather tool."}),
    "deepseek_v31": ("qwen3", "deepseek_v3", True, "call_1", {"content": None}),
    "kimi_k2": ("", "kimi_k2", False, "functions.get_weather:0", {"content": ""}),
    "glm45": ("qwen3", "glm45", False, "call_1", {"content": "", "reasoning_content": "The user wants weather."}),
    "gpt_oss": ("gpt_oss", "gpt_oss", False, "call_1", {"reasoning_content": "Use the weather tool."}),
}
#: Templates that read arguments as a mapping get them as one (as vLLM passes them); the others
#: get the JSON text.
MAPPING_ARGUMENTS = {"qwen3_coder", "glm45", "gpt_oss"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, model_cache):
    name = request.param
    directory = ensure_family_tokenizer(name, model_cache)
    return name, directory, load_renderer(directory)


def chat(name: str, with_result: bool = True) -> list[dict]:
    _, _, _, call_id, turn = FAMILIES[name]
    arguments = ARGS if name in MAPPING_ARGUMENTS else json.dumps(ARGS)
    assistant = {"role": "assistant", **turn,
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": arguments}}]}
    if name == "gpt_oss":  # gpt-oss's template reads the reasoning from "thinking"
        assistant["thinking"] = assistant.pop("reasoning_content")
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Weather in Paris for 3 days?"}, assistant]
    if with_result:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'})
    return messages


def to_proto(message: dict) -> chat_pb2.ChatMessage:
    proto = chat_pb2.ChatMessage(role=message["role"], tool_call_id=message.get("tool_call_id", ""))
    if message.get("content") is not None:
        proto.content = message["content"]
    reasoning = message.get("reasoning_content", message.get("thinking"))
    if reasoning is not None:
        proto.reasoning_content = reasoning
    for call in message.get("tool_calls", []):
        arguments = call["function"]["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        proto.tool_calls.add(id=call["id"], type="function",
                             function=chat_pb2.FunctionCall(name=call["function"]["name"], arguments=text))
    return proto


def request(messages: list[dict], add_generation_prompt: bool = True) -> render_pb2.RenderChatRequest:
    parameters = struct_pb2.Struct()
    parameters.update(PARAMS)
    tool = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name="get_weather", description="Weather for a city", parameters=parameters))
    return render_pb2.RenderChatRequest(messages=[to_proto(m) for m in messages], tools=[tool], return_prompt_text=True,
                                        add_generation_prompt=add_generation_prompt)


def reference_text(name: str, tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The stored template rendered with plain jinja2 the way Hugging Face sets it up."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise AssertionError(message)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(chat_template(name)).render(
        messages=copy.deepcopy(messages), tools=[TOOL], add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


def turn_reasoning(name: str) -> str:
    return FAMILIES[name][4].get("reasoning_content", "")


def test_render_detects_the_familys_parsers(family):
    name, _, renderer = family
    reasoning, tool, skip_special, _, _ = FAMILIES[name]
    model = renderer.model
    assert (model.reasoning_parser, model.tool_parser) == (reasoning, tool)
    assert model.keep_special_tokens is (not skip_special)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_with_tools_call_and_result_renders_as_the_real_template(family, add_generation_prompt):
    name, _, renderer = family
    messages = chat(name)
    response = chat_response(renderer, request(messages, add_generation_prompt))
    expected = reference_text(name, renderer.model.tokenizer, messages, add_generation_prompt)
    assert response.prompt_text == expected
    assert list(response.generate_request.token_ids) == renderer.model.tokenizer.encode(
        expected, add_special_tokens=False)
    assert response.derender_context.text_options.skip_special_tokens is FAMILIES[name][2]


def test_a_requests_own_skip_special_tokens_wins(family):
    name, _, renderer = family
    chat_request = request(chat(name))
    chat_request.sampling.skip_special_tokens = not FAMILIES[name][2]
    response = chat_response(renderer, chat_request)
    assert response.derender_context.text_options.skip_special_tokens is (not FAMILIES[name][2])


def test_assistant_turn_parses_back_into_the_same_call(family):
    """What the template renders for the assistant's tool-call turn is what the model writes:
    derender, fed its tokens one per engine message, gives back the call, reasoning and content."""
    name, directory, renderer = family
    _, _, _, call_id, turn = FAMILIES[name]
    messages = chat(name, with_result=False)
    prompt = chat_response(renderer, request(messages[:-1]))
    full = reference_text(name, renderer.model.tokenizer, messages, add_generation_prompt=False)
    if name == "deepseek_r1":
        # R1's prompt opens <think> and its history drops reasoning: the model writes its
        # reasoning, </think>, then the call as the template renders it after <｜Assistant｜>.
        history = reference_text(name, renderer.model.tokenizer, messages[:-1], add_generation_prompt=False)
        call_text = full[len(history):].removeprefix("<｜Assistant｜>")
        assert prompt.prompt_text.endswith("<think>\n") and call_text.startswith("<｜tool▁calls▁begin｜>")
        output = turn_reasoning(name) + "</think>\n\n" + call_text
    else:
        assert full.startswith(prompt.prompt_text)
        output = full[len(prompt.prompt_text):]
    for end in ("<|im_end|>\n", "<｜end▁of▁sentence｜>", "<|end|>"):
        output = output.removesuffix(end)
    tokenizer = TextTokenizer.load(directory)
    stream = DerenderStream(tokenizer, context_from_proto(prompt.derender_context))
    chunks = []
    for token_id in hf_of(tokenizer).encode(output, add_special_tokens=False):
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    calls: dict[int, list[str]] = {}
    for delta in (d for chunk in chunks for d in chunk.tool_calls):
        if delta.name:
            calls[delta.index] = [delta.id, delta.name, ""]
        calls[delta.index][2] += delta.arguments
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_weather", ARGS)]
    if name == "kimi_k2":
        assert calls[0][0] == call_id
    assert "".join(c.reasoning_content for c in chunks) == turn_reasoning(name)
    assert "".join(c.content for c in chunks) == (turn.get("content") or "")
    assert chunks[-1].finish_reason == FinishReason.TOOL_CALLS


@pytest.mark.parametrize("vocab,template,expected", [
    ({"<tool_call>": 1, "<think>": 2, "</think>": 3}, "{{ '<tool_call>' }}", ("qwen3", "hermes")),
    ({"<tool_call>": 1, "<think>": 2, "</think>": 3}, "<function=x>", ("qwen3", "qwen3_coder")),
    ({"<｜tool▁calls▁begin｜>": 1, "<think>": 2, "</think>": 3}, "{{ '<think>\\n' }}", ("deepseek_r1", "deepseek_v3")),
    ({"<｜tool▁calls▁begin｜>": 1, "<think>": 2, "</think>": 3}, "", ("", "deepseek_v3")),  # V3: no reasoning
    ({"<｜tool▁calls▁begin｜>": 1, "<think>": 2, "</think>": 3}, "{% if thinking %}", ("qwen3", "deepseek_v3")),
    ({"<｜tool▁calls▁begin｜>": 1}, "", ("", "deepseek_v3")),
    ({"<|tool_calls_section_begin|>": 1}, "", ("", "kimi_k2")),
    ({"<tool_call>": 1, "<arg_key>": 2, "<think>": 3, "</think>": 4}, "", ("qwen3", "glm45")),
    ({"<|channel|>": 1, "<|message|>": 2}, "", ("gpt_oss", "gpt_oss")),
    ({"hello": 1}, "", ("", "")),
])
def test_auto_detection_by_vocabulary_and_template(vocab, template, expected):
    assert detect_parsers(vocab, "auto", "auto", template) == expected
    assert detect_parsers(vocab, "none", "kimi_k2", template) == ("", "kimi_k2")  # explicit names win


def test_render_offers_exactly_the_parsers_derender_knows():
    from tito_derender.parsers import REASONING_PARSERS as DERENDER_REASONING
    from tito_derender.parsers import TOOL_PARSERS as DERENDER_TOOLS
    from tito_render.config import REASONING_PARSERS, TOOL_PARSERS
    from tito_render.families import PARSER_MARKERS

    assert set(TOOL_PARSERS) == set(DERENDER_TOOLS)
    assert set(REASONING_PARSERS) == set(DERENDER_REASONING)
    assert set(PARSER_MARKERS) <= set(TOOL_PARSERS) | set(REASONING_PARSERS)
    for name in TOOL_PARSERS:
        RenderConfig(model="x", tool_parser=name).validate()
