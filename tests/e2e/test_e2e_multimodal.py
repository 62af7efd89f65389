"""End to end with an image: `tito serve render|engine|derender` as processes on the tiny
Qwen2-VL model, render signing media items and the engine requiring signed features; a chat with
a data: URL image through ChatPipeline streams the text of HF's greedy tokens."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from tito import tensors
from tito.grpc_errors import error_details
from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, engine_pb2, render_pb2

from images import noise_data_url as data_url
from service_processes import running_services, signed_media_args

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def services(tiny_vl_model, tmp_path_factory):
    """The three services as processes on Unix sockets; render and engine share an HMAC key file."""
    directory = tmp_path_factory.mktemp("mm-e2e")
    with running_services(tiny_vl_model, directory, "auto", signed_media_args(directory)) as (addresses, _):
        yield addresses


def chat_request(url: str) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[
            chat_pb2.ContentPart(text="What is in this picture?"),
            chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=url))])],
        sampling=render_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))


def hf_greedy(model, generate_request: engine_pb2.GenerateRequest) -> list[int]:
    ids = torch.tensor([list(generate_request.token_ids)])
    types = torch.zeros_like(ids)
    items = generate_request.mm_features.items
    for item in items:
        types[0, item.placeholder.offset:item.placeholder.offset + item.placeholder.length] = 1
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pixel_values=torch.cat([tensors.to_torch(item.kwargs["pixel_values"]) for item in items]),
            image_grid_thw=torch.cat([tensors.to_torch(item.metadata["image_grid_thw"]).reshape(-1, 3)
                                      for item in items]))
    return output[0, ids.shape[1]:].tolist()


def test_image_chat_streams_the_text_of_hf_greedy_tokens(services, tiny_vl_model):
    request = chat_request(data_url(84, 56, seed=3))
    with ChatPipeline(Endpoints(**services), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(request, timeout=60)
        item = rendered.generate_request.mm_features.items[0]
        assert item.auth_tag and item.kwargs["pixel_values"].data  # signed, with tensors
        chunks = list(pipeline.stream_chat(request))
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model, dtype=torch.float32).eval()
    expected = hf_greedy(model, rendered.generate_request)
    assert len(set(expected)) > 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_model)
    content = "".join(chunk.content for chunk in chunks)
    assert content == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.prompt_tokens == len(rendered.generate_request.token_ids)


def test_engine_refuses_tampered_features_and_keeps_serving(services):
    request = chat_request(data_url(56, 56, seed=4))
    with ChatPipeline(Endpoints(**services), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(request, timeout=60)
        tampered = engine_pb2.GenerateRequest()
        tampered.CopyFrom(rendered.generate_request)
        tampered.mm_features.items[0].mm_hash = "cd" * 32
        with pytest.raises(grpc.RpcError) as info:
            list(pipeline.engine.Generate(tampered, timeout=60))
        details = error_details(info.value)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["fields"] == ["mm_features.items[0].auth_tag"]
        tokens = [t for r in pipeline.engine.Generate(rendered.generate_request, timeout=60) for t in r.token_ids]
        assert tokens


def _tito_chat(services, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tito_cli", "chat", "What colour is this?", *extra, "--max-tokens", "8",
         "--render", services["render"], "--engine", services["engine"], "--derender", services["derender"]],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "completion_tokens=8" in result.stdout
    return result.stdout


def test_tito_chat_with_an_image_file(services, tmp_path):
    image = tmp_path / "red.png"
    Image.new("RGB", (120, 90), (200, 30, 40)).save(image)
    with_image = _tito_chat(services, "--image", str(image))
    without = _tito_chat(services)
    prompt_tokens = [int(out.split("prompt_tokens=")[1].split()[0]) for out in (with_image, without)]
    # The image adds <|vision_start|>, its <|image_pad|> run and <|vision_end|> to the prompt.
    assert prompt_tokens[0] > prompt_tokens[1] + 2
