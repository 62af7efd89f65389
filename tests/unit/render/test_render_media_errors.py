"""Media caller mistakes and limits: each a field-named InvalidArgument (or ResourceExhausted for
the response size), and the renderer keeps working."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import time
import zlib

import pytest

from tito.errors import InvalidArgument, ResourceExhausted
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.media.loader import MediaPolicy
from tito_render.model import load_render_model
from tito_render.renderer import Renderer, RenderLimits
from tito_render.convert import chat_response, completion_response

from images import jpeg, noise_image as picture, png

IMAGE = "messages[0].content_parts[0].image"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG claiming width x height: what a decompression bomb shows before any pixel is decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


def chat(*sources: chat_pb2.ImageSource, text: str | None = None, **fields) -> render_pb2.RenderChatRequest:
    parts = [chat_pb2.ContentPart(image=s) for s in sources]
    if text is not None:
        parts.append(chat_pb2.ContentPart(text=text))
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=parts)],
                                        **fields)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png(picture(40, 30)))
    (root / "secret.png").write_bytes(png(picture(40, 30)))
    (allowed / "link.png").symlink_to(root / "secret.png")
    return allowed


@pytest.fixture(scope="module")
def model(tiny_vl_model):
    return load_render_model(RenderConfig(model=str(tiny_vl_model)))


def limited(model, media_dir=None, **overrides) -> Renderer:
    policy = dict(media_dir=media_dir.resolve() if media_dir else None, max_image_bytes=200_000,
                  max_image_pixels=4_000_000)
    policy.update({k: overrides.pop(k) for k in list(overrides) if k in MediaPolicy.__dataclass_fields__})
    limits = dict(max_images_per_request=3, max_prompt_tokens=400)
    limits.update(overrides)
    return Renderer(model, RenderLimits(media=MediaPolicy(**policy), **limits))


@pytest.fixture(scope="module")
def renderer(model, media_dir) -> Renderer:
    return limited(model, media_dir)


def still_works(renderer: Renderer) -> None:
    response = chat_response(renderer, chat(chat_pb2.ImageSource(data=png(picture(50, 50)))))
    assert len(response.generate_request.mm_features.items) == 1


def data(raw: bytes) -> chat_pb2.ImageSource:
    return chat_pb2.ImageSource(data=raw)


def url(text: str) -> chat_pb2.ImageSource:
    return chat_pb2.ImageSource(url=text)


BAD = {
    "corrupt": (lambda d: chat(data(b"definitely not an image")), "CORRUPT_IMAGE", f"{IMAGE}.data"),
    "truncated_png": (lambda d: chat(data(png(picture(300, 200))[:3000])), "CORRUPT_IMAGE", f"{IMAGE}.data"),
    "truncated_jpeg": (lambda d: chat(data(jpeg(picture(300, 200))[:2000])), "CORRUPT_IMAGE", f"{IMAGE}.data"),
    "empty_data": (lambda d: chat(data(b"")), "CORRUPT_IMAGE", f"{IMAGE}.data"),
    "empty_source": (lambda d: chat(chat_pb2.ImageSource()), "EMPTY_IMAGE_SOURCE", IMAGE),
    "unsupported_scheme": (lambda d: chat(url("ftp://example.com/cat.png")), "UNSUPPORTED_MEDIA_URL", f"{IMAGE}.url"),
    "file_url_with_host": (lambda d: chat(url("file://server/share/cat.png")), "UNSUPPORTED_MEDIA_URL",
                           f"{IMAGE}.url"),
    # Outside the media directory answers like a missing file: no probing which files exist.
    "dotdot_outside_dir": (lambda d: chat(url("../secret.png")), "MEDIA_NOT_FOUND", f"{IMAGE}.url"),
    "absolute_outside_dir": (lambda d: chat(url(f"file://{d.parent}/secret.png")), "MEDIA_NOT_FOUND",
                             f"{IMAGE}.url"),
    "symlink_outside_dir": (lambda d: chat(url("link.png")), "MEDIA_NOT_FOUND", f"{IMAGE}.url"),
    "missing_file": (lambda d: chat(url("nope.png")), "MEDIA_NOT_FOUND", f"{IMAGE}.url"),
    "remote_disabled": (lambda d: chat(url("https://example.com/cat.png")), "REMOTE_MEDIA_DISABLED", f"{IMAGE}.url"),
    "bad_base64": (lambda d: chat(url("data:image/png;base64,@@@@")), "INVALID_DATA_URL", f"{IMAGE}.url"),
    "data_url_not_image": (lambda d: chat(url("data:text/plain;base64,aGk=")), "INVALID_DATA_URL", f"{IMAGE}.url"),
    "data_url_not_base64": (lambda d: chat(url("data:image/png,rawbytes")), "INVALID_DATA_URL", f"{IMAGE}.url"),
    "oversized_bytes": (lambda d: chat(data(png(picture(300, 300)))), "IMAGE_TOO_LARGE", f"{IMAGE}.data"),
    "oversized_data_url": (lambda d: chat(url("data:image/png;base64," + base64.b64encode(
        png(picture(300, 300))).decode())), "IMAGE_TOO_LARGE", f"{IMAGE}.url"),
    "too_many_pixels": (lambda d: chat(data(png_header_only(3000, 2000))), "IMAGE_TOO_MANY_PIXELS", f"{IMAGE}.data"),
    "decompression_bomb": (lambda d: chat(data(png_header_only(40000, 40000))), "IMAGE_TOO_MANY_PIXELS",
                           f"{IMAGE}.data"),
    "too_many_images": (lambda d: chat(*[data(png(picture(30, 30)))] * 4), "TOO_MANY_IMAGES",
                        "messages[0].content_parts[3].image"),
    "extreme_aspect_ratio": (lambda d: chat(data(png(picture(1000, 2)))), "IMAGE_PROCESSING_FAILED", IMAGE),
    "image_pad_typed_in_text": (lambda d: chat(text="look: <|image_pad|>"), "PLACEHOLDER_IN_TEXT", "messages"),
    "video_pad_typed_in_text": (lambda d: chat(data(png(picture(30, 30))), text="<|video_pad|>"),
                                "PLACEHOLDER_IN_TEXT", "messages"),
    "extra_image_pad_typed": (lambda d: chat(data(png(picture(30, 30))), text="<|image_pad|>"),
                              "PLACEHOLDER_IN_TEXT", "messages"),
    "prompt_over_max_prompt_tokens": (lambda d: chat(text="word " * 500), "PROMPT_TOO_LONG", "messages"),
    "unknown_mm_payload": (lambda d: chat(data(png(picture(30, 30))), mm_payload=9), "INVALID_MM_PAYLOAD",
                           "mm_payload"),
    "template_drops_images": (lambda d: chat(data(png(picture(30, 30))), text="x",
                                             chat_template="{% for m in messages %}{{ m.role }}{% endfor %}"),
                              "TEMPLATE_DROPS_IMAGES", "chat_template"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_media_is_invalid_argument_naming_the_field(renderer, media_dir, name):
    build, reason, field = BAD[name]
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, build(media_dir))
    assert (err.value.reason, err.value.field) == (reason, field), err.value.message
    still_works(renderer)


def test_limit_errors_name_the_limit(renderer):
    for request, limit in [(chat(data(png(picture(300, 300)))), "max_image_bytes"),
                           (chat(data(png_header_only(3000, 2000))), "max_image_pixels"),
                           (chat(*[data(png(picture(30, 30)))] * 4), "max_images_per_request"),
                           (chat(text="word " * 500), "max_prompt_tokens")]:
        with pytest.raises(InvalidArgument) as err:
            chat_response(renderer, request)
        assert limit in err.value.message and err.value.metadata["limit"] == limit


@pytest.mark.parametrize("options, field", [
    ({"processor_kwargs": {"patch_size": 16}}, "media_options.processor_kwargs.patch_size"),
    ({"processor_kwargs": {"resample": "lanczos"}}, "media_options.processor_kwargs.resample"),
    ({"max_pixels": 5_000_000}, "media_options.max_pixels"),
    ({"min_pixels": 0}, "media_options.min_pixels"),
    ({"min_pixels": 60_000, "max_pixels": 50_000}, "media_options.min_pixels"),
])
def test_bad_media_options(renderer, options, field):
    request = chat(data(png(picture(30, 30))))
    kwargs = options.pop("processor_kwargs", None)
    for key, value in options.items():
        setattr(request.media_options, key, value)
    if kwargs:
        request.media_options.processor_kwargs.update(kwargs)
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, request)
    assert err.value.field == field
    still_works(renderer)


def test_local_files_under_media_dir(renderer, media_dir):
    by_name = chat_response(renderer, chat(url("cat.png"))).generate_request.mm_features.items[0]
    by_url = chat_response(renderer, chat(url(f"file://{media_dir}/cat.png"))).generate_request.mm_features.items[0]
    by_data = chat_response(renderer, chat(data((media_dir / "cat.png").read_bytes()))).generate_request \
        .mm_features.items[0]
    assert by_name.mm_hash == by_url.mm_hash == by_data.mm_hash


def test_local_files_refused_without_media_dir(model):
    with pytest.raises(InvalidArgument) as err:
        chat_response(limited(model), chat(url("cat.png")))
    assert (err.value.reason, err.value.field) == ("LOCAL_MEDIA_DISABLED", f"{IMAGE}.url")


def test_completion_refuses_placeholder_tokens(renderer):
    with pytest.raises(InvalidArgument) as err:
        completion_response(renderer, render_pb2.RenderCompletionRequest(prompt="a <|image_pad|> b"))
    assert (err.value.reason, err.value.field) == ("PLACEHOLDER_IN_TEXT", "prompt")
    with pytest.raises(InvalidArgument) as err:
        completion_response(renderer, render_pb2.RenderCompletionRequest(prompt_token_ids=[10, 1005, 11]))
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidArgument) as err:
        completion_response(renderer, render_pb2.RenderCompletionRequest(prompt_token_ids=[10] * 401))
    assert err.value.reason == "PROMPT_TOO_LONG" and "max_prompt_tokens" in err.value.message


def test_response_over_max_message_bytes_is_resource_exhausted(model):
    small = limited(model, max_response_bytes=100_000, max_image_bytes=20_000_000)
    request = chat(data(png(picture(1920, 1080))))
    with pytest.raises(ResourceExhausted) as err:
        chat_response(small, request)
    assert err.value.field == "mm_payload" and "max_message_bytes" in err.value.message
    request.mm_payload = multimodal_pb2.MM_PAYLOAD_METADATA
    assert chat_response(small, request).ByteSize() < 2048


# --------------------------------------------------------------------------- remote


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = png(picture(64, 48))

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path == "/slow.png":
            time.sleep(1.5)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body = self.body * 200 if self.path == "/big.png" else self.body
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_images_when_enabled(model, http_server):
    remote = limited(model, allow_remote=True, fetch_timeout=0.5)
    item = chat_response(remote, chat(url(f"{http_server}/cat.png"))).generate_request.mm_features.items[0]
    local = chat_response(remote, chat(data(_ImageHandler.body))).generate_request.mm_features.items[0]
    assert item.mm_hash == local.mm_hash
    for path, reason in [("/missing.png", "MEDIA_FETCH_FAILED"), ("/big.png", "IMAGE_TOO_LARGE"),
                         ("/slow.png", "MEDIA_FETCH_TIMEOUT")]:
        with pytest.raises(InvalidArgument) as err:
            chat_response(remote, chat(url(http_server + path)))
        assert (err.value.reason, err.value.field) == (reason, f"{IMAGE}.url"), err.value.message
    with pytest.raises(InvalidArgument) as err:
        chat_response(remote, chat(url("http://127.0.0.1:9/none.png")))  # nothing listens on port 9
    assert err.value.reason == "MEDIA_FETCH_FAILED"
