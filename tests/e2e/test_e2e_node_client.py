"""The Node.js client (clients/node) against the three services as processes on the tiny
Qwen2-VL model, render signing media items and the engine requiring signed features: its image
chat streams the same text as the Python pipeline (so grpc-js forwarded the signed features
unchanged), a plain object for a Struct field is dropped while toStruct() arrives, a cancelled
stream and one past its deadline leave the engine idle, and a bad token id decodes to ErrorInfo
and BadRequest."""

from __future__ import annotations

import json
import subprocess

import pytest
from PIL import Image

from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, render_pb2

from node_project import NODE_DIR, ensure_installed, run_tool
from service_processes import running_services, signed_media_args

pytestmark = [pytest.mark.e2e, pytest.mark.node]

MAX_TOKENS = 8
PROMPT = "What is in this picture?"


@pytest.fixture(scope="module")
def services(tiny_vl_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("node-e2e")
    extra = signed_media_args(directory, key="node-e2e-shared-key-0123456789")
    with running_services(tiny_vl_model, directory, "auto", extra) as (addresses, _):
        yield addresses


@pytest.fixture(scope="module")
def node_client():
    """clients/node installed and compiled (tsc type-checks it on the way)."""
    ensure_installed()
    run_tool("tsc", "-p", "tsconfig.json")
    return NODE_DIR / "dist" / "chat.js"


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("node-image") / "red.png"
    Image.new("RGB", (84, 56), (200, 30, 40)).save(path)
    return path


@pytest.fixture(scope="module")
def steps(services, node_client, image_file) -> dict[str, dict]:
    result = subprocess.run(
        ["node", str(node_client), "--render", services["render"], "--engine", services["engine"],
         "--derender", services["derender"], "--image", str(image_file), "--prompt", PROMPT,
         "--max-tokens", str(MAX_TOKENS), "--timeout-seconds", "120"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return {line.pop("step"): line for line in lines}


def test_health_and_model_info_with_enum_names_and_64_bit_strings(steps):
    assert steps["health"] == {"render": "SERVING", "engine": "SERVING", "derender": "SERVING"}
    assert "MODALITY_IMAGE" in steps["model_info"]["modalities"]
    assert isinstance(steps["model_info"]["finished_requests"], str)  # uint64 -> decimal string


def test_a_plain_object_for_a_struct_is_dropped_and_to_struct_arrives(steps):
    assert steps["struct"] == {"plain_object_prompt": "Hi|", "to_struct_prompt": "Hi|hello from node"}


def test_image_chat_streams_what_the_python_pipeline_streams(steps, services, image_file):
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[
            chat_pb2.ContentPart(text=PROMPT),
            chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=image_file.read_bytes()))])],
        sampling=render_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, seed=2**64 - 1))
    with ChatPipeline(Endpoints(**services), timeout=120) as pipeline:
        chunks = list(pipeline.stream_chat(request))
    chat = steps["chat"]
    assert chat["content"] == "".join(chunk.content for chunk in chunks) and chat["content"]
    assert chat["finish_reason"] == "FINISH_REASON_LENGTH"
    assert chat["usage"]["completion_tokens"] == MAX_TOKENS
    assert chat["usage"]["prompt_tokens"] == chunks[-1].usage.prompt_tokens > 20  # the image's tokens


def test_a_cancelled_stream_ends_cancelled_and_frees_the_engine(steps):
    cancel = steps["cancel"]
    assert cancel["code"] == "CANCELLED" and cancel["received"] >= 1
    assert cancel["running_requests"] == 0


def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_frees_the_engine(steps):
    # 2000 tokens under a 150 ms deadline: a slower machine only makes the deadline surer.
    assert steps["deadline"]["code"] == "DEADLINE_EXCEEDED"
    assert steps["deadline"]["running_requests"] == 0


def test_a_bad_token_id_decodes_to_error_info_and_bad_request(steps):
    error = steps["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["reason"] == "TOKEN_ID_OUT_OF_RANGE" and error["domain"] == "tito.dev"
    assert [violation["field"] for violation in error["fieldViolations"]] == ["token_ids[1]"]
