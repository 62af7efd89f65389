"""Images through a real render server (port 0): response sizes per mm_payload, signed items,
field-named errors after which the server keeps serving, the response-size limit."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from PIL import Image

from tito import signing
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2, render_pb2_grpc
from tito_render.config import RenderConfig
from tito_render.server import create_server
from tito_render.servicer import WORKER_PID_KEY

from images import noise_image as picture, png

TIMEOUT = 30
KEY = b"0123456789abcdef0123456789abcdef"
IMAGE = "messages[0].content_parts[0].image"


def smooth(width: int, height: int) -> Image.Image:
    """A gradient: compresses well, so a large image still fits a small request."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.broadcast_to((x + y) / 2, (height, width, 3)).astype(np.uint8))


def image_chat(source: chat_pb2.ImageSource, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(image=source), chat_pb2.ContentPart(text="What is in this picture?")])], **fields)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png(picture(64, 64)))
    (root / "secret.png").write_bytes(png(picture(64, 64)))
    return root / "allowed"


@pytest.fixture(scope="module")
def server(tiny_vl_model, media_dir, tmp_path_factory, module_aio_server):
    key_file = tmp_path_factory.mktemp("keys") / "render.key"
    key_file.write_bytes(KEY + b"\n")
    config = RenderConfig(model=str(tiny_vl_model), media_dir=str(media_dir), hmac_key_file=str(key_file),
                          hmac_key_id="k1", max_image_bytes=8 * 1024 * 1024, max_image_pixels=16_000_000)
    return module_aio_server(lambda: create_server(config))


@pytest.fixture(scope="module")
def stub(server):
    channel = server.channel()
    yield render_pb2_grpc.RenderServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def full_hd() -> bytes:
    return png(picture(1920, 1080))


def test_response_sizes_for_a_1920x1080_image(stub, full_hd, capsys):
    sizes = {}
    for mode in (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA, multimodal_pb2.MM_PAYLOAD_NONE):
        response, call = stub.RenderChat.with_call(
            image_chat(chat_pb2.ImageSource(data=full_hd), mm_payload=mode), timeout=TIMEOUT)
        assert dict(call.trailing_metadata())[WORKER_PID_KEY] == str(os.getpid())
        item = response.generate_request.mm_features.items[0]
        assert signing.verify_item(item, {"k1": KEY})
        raw = sum(len(t.data) for t in item.kwargs.values()) + sum(len(t.data) for t in item.metadata.values())
        sizes[multimodal_pb2.MmPayload.Name(mode)] = (response.ByteSize(), raw)
    tensors_size, tensors_raw = sizes["MM_PAYLOAD_TENSORS"]
    assert tensors_raw > 1_000_000 and tensors_size <= tensors_raw + 4096
    assert sizes["MM_PAYLOAD_METADATA"][0] <= 2048 and sizes["MM_PAYLOAD_NONE"][0] <= 2048
    with capsys.disabled():
        print("\nrender response bytes for one 1920x1080 image (tiny-qwen2-vl):",
              ", ".join(f"{name.removeprefix('MM_PAYLOAD_')} {size} (raw tensors {raw})"
                        for name, (size, raw) in sizes.items()))


def good_image_chat(stub) -> None:
    response = stub.RenderChat(image_chat(chat_pb2.ImageSource(url="cat.png")), timeout=TIMEOUT)
    assert len(response.generate_request.mm_features.items) == 1


def _truncated() -> bytes:
    return png(picture(200, 200))[:1500]


def _bomb() -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


BAD = {
    "corrupt": (image_chat(chat_pb2.ImageSource(data=b"GIF89a-but-not-really")), f"{IMAGE}.data"),
    "truncated": (image_chat(chat_pb2.ImageSource(data=_truncated())), f"{IMAGE}.data"),
    "unsupported_scheme": (image_chat(chat_pb2.ImageSource(url="gopher://host/cat.png")), f"{IMAGE}.url"),
    "outside_media_dir": (image_chat(chat_pb2.ImageSource(url="../secret.png")), f"{IMAGE}.url"),
    "oversized": (image_chat(chat_pb2.ImageSource(data=b"\x89PNG" + b"\0" * (8 * 1024 * 1024))), f"{IMAGE}.data"),
    "decompression_bomb": (image_chat(chat_pb2.ImageSource(data=_bomb())), f"{IMAGE}.data"),
    "unknown_role": (render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="robot", content="x")]),
                     "messages[0].role"),
    "tool_call_invalid_json": (render_pb2.RenderChatRequest(messages=[
        chat_pb2.ChatMessage(role="user", content="hi"),
        chat_pb2.ChatMessage(role="assistant", tool_calls=[chat_pb2.ToolCall(
            id="c1", function=chat_pb2.FunctionCall(name="f", arguments="{not json"))])]),
        "messages[1].tool_calls[0].function.arguments"),
}


def video_chat(frames: list[chat_pb2.ImageSource], **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=frames, fps=2)),
        chat_pb2.ContentPart(text="What happens?")])], **fields)


BAD["video_too_many_frames"] = (video_chat([chat_pb2.ImageSource(url="cat.png")] * 65),
                                "messages[0].content_parts[0].video.frames[64]")  # --max-video-frames 64
BAD["video_frames_over_images_per_request"] = (video_chat([chat_pb2.ImageSource(url="cat.png")] * 40),
                                               "messages[0].content_parts[0].video.frames[32]")
BAD["video_frame_outside_media_dir"] = (
    video_chat([chat_pb2.ImageSource(url="cat.png"), chat_pb2.ImageSource(url="../secret.png")]),
    "messages[0].content_parts[0].video.frames[1].url")
BAD["video_frame_corrupt"] = (video_chat([chat_pb2.ImageSource(url="cat.png"), chat_pb2.ImageSource(data=b"x")]),
                              "messages[0].content_parts[0].video.frames[1].data")


def test_video_through_the_server_is_signed_in_every_payload_mode(stub):
    frames = [chat_pb2.ImageSource(url="cat.png"), chat_pb2.ImageSource(data=png(picture(64, 64, seed=1))),
              chat_pb2.ImageSource(data=png(picture(64, 64, seed=2)))]
    responses = {mode: stub.RenderChat(video_chat(frames, mm_payload=mode), timeout=TIMEOUT)
                 for mode in (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA,
                              multimodal_pb2.MM_PAYLOAD_NONE)}
    ids = [list(r.generate_request.token_ids) for r in responses.values()]
    assert ids[0] == ids[1] == ids[2]
    for mode, response in responses.items():
        (item,) = response.generate_request.mm_features.items
        assert item.modality == multimodal_pb2.MODALITY_VIDEO and signing.verify_item(item, {"k1": KEY})
        assert item.placeholder.length == 2 * 4 * 4 // 4  # 3 frames -> grid_t 2, 64x64 -> 56x56: 4x4 patches
        if mode == multimodal_pb2.MM_PAYLOAD_TENSORS:
            assert list(item.kwargs["pixel_values_videos"].shape) == [32, 3 * 2 * 14 * 14]
        assert bool(item.kwargs) == (mode == multimodal_pb2.MM_PAYLOAD_TENSORS)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_request_names_the_field_and_server_keeps_serving(stub, name):
    request, field = BAD[name]
    with pytest.raises(grpc.RpcError) as err:
        stub.RenderChat(request, timeout=TIMEOUT)
    details = error_details(err.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details["fields"][0] == field, details
    assert field.split(".")[-1] in details["message"] or details["reason"], details
    good_image_chat(stub)


def test_model_info_reports_image_and_video_modalities(stub):
    info = stub.GetModelInfo(render_pb2.RenderServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert list(info.modalities) == [multimodal_pb2.MODALITY_IMAGE, multimodal_pb2.MODALITY_VIDEO]


def test_response_over_max_message_bytes_is_resource_exhausted(aio_server, tiny_vl_model):
    config = RenderConfig(model=str(tiny_vl_model), max_message_bytes=1024 * 1024)
    running = aio_server(lambda: create_server(config))
    with running.channel() as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RenderChat(image_chat(chat_pb2.ImageSource(data=png(smooth(1280, 720)))), timeout=TIMEOUT)
        details = error_details(err.value)
        assert details["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details["reason"] == "RESPONSE_TOO_LARGE" and "max_message_bytes" in details["message"]
        small = stub.RenderChat(image_chat(chat_pb2.ImageSource(data=png(smooth(1280, 720))),
                                           mm_payload=multimodal_pb2.MM_PAYLOAD_METADATA), timeout=TIMEOUT)
        assert len(small.generate_request.mm_features.items[0].kwargs) == 0
