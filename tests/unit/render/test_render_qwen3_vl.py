"""Qwen3-VL rendering: prompt ids, pixel_values / pixel_values_videos, grids and is_embed masks equal
transformers' Qwen3VLProcessor (its own text expansion with the timestamp text between frames,
mm_token_type_ids, its image processor) for images, a video at two frame rates and an image + video
chat; the is_embed positions number exactly the encoder's output rows; hashes, payload modes and the
video size choice of Qwen3VLVideoProcessor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tito.errors import InvalidArgument
from tito.tensors import to_numpy
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2
from tito_render.media.video import VideoSettings, load_video_settings, resized_size
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

from hf_video import hf_video_rows, video_processor_class
from images import noise_image as picture, png
from renderers import load_renderer

TENSORS, METADATA, NONE = (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA,
                           multimodal_pb2.MM_PAYLOAD_NONE)
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1005, 1006, 1003, 1004


def frames_of(count: int, width: int = 80, height: int = 64, seed: int = 0) -> list[Image.Image]:
    return [picture(width, height, seed=seed + k) for k in range(count)]


def video_part(frames: list[Image.Image], fps: float = 0.0) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=png(f)) for f in frames],
                                                           fps=fps))


def image_part(image: Image.Image) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(image)))


def text_part(text: str) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(text=text)


def chat(*parts: chat_pb2.ContentPart, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))],
                                        **fields)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_vl_model) -> Renderer:
    return load_renderer(tiny_qwen3_vl_model)


@pytest.fixture(scope="module")
def hf_video_processor_class():
    """transformers' Qwen3VLVideoProcessor class: its torch-only code (patchify, the size choice in
    resize) and class defaults serve as the reference."""
    return video_processor_class("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor")


def hf_video_size(video_processor_class, frames: int, height: int, width: int, settings: VideoSettings,
                  monkeypatch) -> tuple[int, int]:
    """The size Qwen3VLVideoProcessor.resize hands to the (torchvision) resize."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    chosen = {}
    monkeypatch.setattr(TorchvisionBackend, "resize",
                        lambda self, image, size, resample, **kw: chosen.setdefault("size", (size.height, size.width)))
    processor = object.__new__(video_processor_class)  # no __init__: it would need torchvision
    processor.max_video_tokens = settings.max_video_tokens
    video_processor_class.resize(processor, torch.zeros(1, 1, 1, 1, 1).expand(1, frames, 3, height, width),
                                 SizeDict(shortest_edge=settings.min_pixels, longest_edge=settings.max_pixels),
                                 settings.resample, settings.factor, settings.temporal_patch_size,
                                 settings.cap_pixels_per_frame)
    return chosen["size"]


def pil_image_processor(renderer: Renderer):
    """The model's image processor on HF's PIL backend (what render's video math reproduces; where
    torchvision imports, AutoImageProcessor picks the torchvision backend instead)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**renderer.model.media.image_processor.to_dict())


def hf_reference(renderer: Renderer, frames: list[Image.Image], video_processor_class, monkeypatch):
    """HF's video computation: the size Qwen3VLVideoProcessor.resize chooses, the model's image
    processor (PIL backend) resizing, rescaling and normalizing each frame to it, then
    Qwen3VLVideoProcessor.patchify (HF's code) padding the frames and laying out the patches."""
    processor = pil_image_processor(renderer)
    settings = renderer.model.media.video
    with monkeypatch.context() as patch:
        height, width = hf_video_size(video_processor_class, len(frames), frames[0].height, frames[0].width,
                                      settings, patch)
    return hf_video_rows(processor, settings, frames, (height, width), video_processor_class)


class StandInVideoProcessor:
    """What Qwen3VLProcessor needs of its video processor (the real one imports torchvision): the
    pixels from `hf_reference` and the video metadata from HF's own `make_batched_metadata`."""

    temporal_patch_size = 2
    merge_size = 2

    def __init__(self, renderer: Renderer, video_processor_class, monkeypatch):
        self.renderer, self.video_processor_class, self.monkeypatch = renderer, video_processor_class, monkeypatch

    def __call__(self, videos, video_metadata=None, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata

        outputs = [hf_reference(self.renderer, list(frames), self.video_processor_class, self.monkeypatch)
                   for frames in videos]
        metadata = make_batched_metadata([np.stack([np.asarray(f) for f in frames]) for frames in videos],
                                         video_metadata)
        return BatchFeature({"pixel_values_videos": np.concatenate([rows for rows, _ in outputs]),
                             "video_grid_thw": np.concatenate([grid for _, grid in outputs]),
                             "video_metadata": metadata})


@pytest.fixture
def hf_processor(qwen3, hf_video_processor_class, monkeypatch):
    """transformers' Qwen3VLProcessor (its replace_image_token / replace_video_token with the
    timestamps, the text expansion, tokenization and mm_token_type_ids) around the model's image
    processor and tokenizer and the stand-in video processor; its __init__ is skipped (it looks the
    video processor class up, which needs torchvision)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor = object.__new__(Qwen3VLProcessor)
    processor.image_processor = qwen3.model.media.image_processor
    processor.tokenizer = qwen3.model.tokenizer
    processor.video_processor = StandInVideoProcessor(qwen3, hf_video_processor_class, monkeypatch)
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id, processor.video_token_id = IMAGE_PAD, VIDEO_PAD
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    processor.vision_start_token_id, processor.vision_end_token_id = VISION_START, VISION_END
    return processor


def hf_run(qwen3: Renderer, processor, content: list[dict], images=None, videos=None, fps=None):
    text = qwen3.model.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
    metadata = None
    if videos is not None:
        metadata = [{"total_num_frames": len(v), "fps": fps or None, "frames_indices": list(range(len(v)))}
                    for v in videos]
    return processor(text=[text], images=images, videos=videos, video_metadata=metadata, return_tensors="np")


def embed_positions(item) -> list[int]:
    placeholder = item.placeholder
    mask = list(placeholder.is_embed) or [True] * placeholder.length
    return [placeholder.offset + k for k, on in enumerate(mask) if on]


def encoder_rows(tiny_qwen3_vl_model, item) -> int:
    """The rows the model's own vision tower produces for the item (its pooler output)."""
    model = _model(tiny_qwen3_vl_model)
    with torch.inference_mode():
        if item.modality == multimodal_pb2.MODALITY_VIDEO:
            out = model.model.get_video_features(
                pixel_values_videos=torch.from_numpy(to_numpy(item.kwargs["pixel_values_videos"])),
                video_grid_thw=torch.from_numpy(to_numpy(item.metadata["video_grid_thw"])), return_dict=True)
        else:
            out = model.model.get_image_features(
                pixel_values=torch.from_numpy(to_numpy(item.kwargs["pixel_values"])),
                image_grid_thw=torch.from_numpy(to_numpy(item.metadata["image_grid_thw"])), return_dict=True)
    (rows,) = out.pooler_output
    assert all(level[0].shape == rows.shape for level in out.deepstack_features)  # DeepStack: same rows
    return rows.shape[0]


_MODELS: dict = {}


def _model(path):
    from transformers import Qwen3VLForConditionalGeneration

    if path not in _MODELS:
        _MODELS[path] = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    return _MODELS[path]


# --------------------------------------------------------------------------- equality with HF


def test_image_chat_equals_hf_processor(qwen3, hf_processor, tiny_qwen3_vl_model):
    images = [picture(100, 70, seed=1), picture(40, 150, seed=2)]
    response = chat_response(qwen3, chat(text_part("Compare"), image_part(images[0]), text_part("and"),
                                      image_part(images[1])))
    content = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
               {"type": "image"}]
    hf = hf_run(qwen3, hf_processor, content, images=images)
    request = response.generate_request
    assert list(request.token_ids) == hf["input_ids"][0].tolist()
    items = request.mm_features.items
    pixels = np.concatenate([to_numpy(item.kwargs["pixel_values"]) for item in items])
    assert pixels.tobytes() == hf["pixel_values"].tobytes()
    grids = np.concatenate([to_numpy(item.metadata["image_grid_thw"]) for item in items])
    assert grids.tolist() == hf["image_grid_thw"].tolist()
    marked = np.flatnonzero(hf["mm_token_type_ids"][0] == 1).tolist()
    assert [p for item in items for p in embed_positions(item)] == marked
    for item in items:
        assert not item.placeholder.is_embed  # an image's span is all pads
        assert len(embed_positions(item)) == encoder_rows(tiny_qwen3_vl_model, item)


@pytest.mark.parametrize("fps", [2.0, 0.5])
def test_video_at_two_frame_rates_equals_hf_processor(qwen3, hf_processor, tiny_qwen3_vl_model, fps):
    frames = frames_of(5, 80, 64, seed=10)
    response = chat_response(qwen3, chat(text_part("Clip:"), video_part(frames, fps=fps), text_part("What happens?")))
    content = [{"type": "text", "text": "Clip:"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    hf = hf_run(qwen3, hf_processor, content, videos=[frames], fps=fps)
    request = response.generate_request
    token_ids = list(request.token_ids)
    assert token_ids == hf["input_ids"][0].tolist()
    (item,) = request.mm_features.items
    assert item.modality == multimodal_pb2.MODALITY_VIDEO
    assert to_numpy(item.kwargs["pixel_values_videos"]).tobytes() == hf["pixel_values_videos"].tobytes()
    assert to_numpy(item.metadata["video_grid_thw"]).tolist() == hf["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert list(item.metadata) == ["video_grid_thw"]
    # is_embed marks exactly HF's video positions (mm_token_type_ids 2), inside one range that
    # also holds the timestamp text and per-frame vision markers.
    marked = np.flatnonzero(hf["mm_token_type_ids"][0] == 2).tolist()
    assert embed_positions(item) == marked and len(marked) == 3 * 4
    assert len(item.placeholder.is_embed) == item.placeholder.length
    assert len(embed_positions(item)) == encoder_rows(tiny_qwen3_vl_model, item)
    span = token_ids[item.placeholder.offset:item.placeholder.offset + item.placeholder.length]
    text = qwen3.model.tokenizer.decode(span)
    stamps = [(0 / fps + 1 / fps) / 2, (2 / fps + 3 / fps) / 2, (4 / fps + 4 / fps) / 2]  # last frame repeated
    assert text == "".join(f"<{t:.1f} seconds><|vision_start|>{'<|video_pad|>' * 4}<|vision_end|>" for t in stamps)
    # The template's own markers stay outside the range.
    assert token_ids[item.placeholder.offset - 1] == VISION_START
    assert token_ids[item.placeholder.offset + item.placeholder.length] == VISION_END


def test_frame_rate_changes_the_text_and_hash_not_the_pixels(qwen3):
    frames = frames_of(4, 64, 64, seed=20)
    slow, fast = (chat_response(qwen3, chat(video_part(frames, fps=fps))).generate_request for fps in (1.0, 4.0))
    (a,), (b,) = slow.mm_features.items, fast.mm_features.items
    assert a.kwargs["pixel_values_videos"].data == b.kwargs["pixel_values_videos"].data
    assert a.mm_hash != b.mm_hash
    assert list(slow.token_ids) != list(fast.token_ids)
    assert list(a.placeholder.is_embed) == list(b.placeholder.is_embed)  # same digits count here


def test_unknown_fps_is_hf_default_of_24(qwen3, hf_processor):
    frames = frames_of(2, 64, 64, seed=25)
    response = chat_response(qwen3, chat(video_part(frames)))
    hf = hf_run(qwen3, hf_processor, [{"type": "video"}], videos=[frames], fps=None)
    assert list(response.generate_request.token_ids) == hf["input_ids"][0].tolist()
    assert "<0.0 seconds>" in qwen3.model.tokenizer.decode(response.generate_request.token_ids)


def test_image_and_video_chat_equals_hf_processor(qwen3, hf_processor, tiny_qwen3_vl_model):
    frames, still = frames_of(4, 96, 64, seed=30), picture(64, 64, seed=40)
    response = chat_response(qwen3, chat(video_part(frames, fps=2.0), text_part("then"), image_part(still),
                                      text_part("same scene?")))
    content = [{"type": "video"}, {"type": "text", "text": "then"}, {"type": "image"},
               {"type": "text", "text": "same scene?"}]
    hf = hf_run(qwen3, hf_processor, content, images=[still], videos=[frames], fps=2.0)
    request = response.generate_request
    assert list(request.token_ids) == hf["input_ids"][0].tolist()
    video, image = request.mm_features.items
    assert [video.modality, image.modality] == [multimodal_pb2.MODALITY_VIDEO, multimodal_pb2.MODALITY_IMAGE]
    assert to_numpy(video.kwargs["pixel_values_videos"]).tobytes() == hf["pixel_values_videos"].tobytes()
    assert to_numpy(image.kwargs["pixel_values"]).tobytes() == hf["pixel_values"].tobytes()
    types_ = hf["mm_token_type_ids"][0]
    assert embed_positions(video) == np.flatnonzero(types_ == 2).tolist()
    assert embed_positions(image) == np.flatnonzero(types_ == 1).tolist()
    for item in (video, image):
        assert len(embed_positions(item)) == encoder_rows(tiny_qwen3_vl_model, item)


# --------------------------------------------------------------------------- video size choice


def test_settings_defaults_equal_hf_class_defaults(hf_video_processor_class):
    cls, defaults = hf_video_processor_class, VideoSettings.qwen3()
    assert (defaults.min_pixels, defaults.max_pixels) == (cls.size["shortest_edge"], cls.size["longest_edge"])
    assert (defaults.patch_size, defaults.temporal_patch_size, defaults.merge_size) == (
        cls.patch_size, cls.temporal_patch_size, cls.merge_size)
    assert defaults.resample == cls.resample and list(defaults.image_mean) == list(cls.image_mean)
    assert list(defaults.image_std) == list(cls.image_std) and defaults.max_video_tokens == cls.max_video_tokens
    assert defaults.budget_over_frames


def test_model_settings_are_read_from_its_video_config(qwen3, tiny_qwen3_vl_model):
    settings = load_video_settings(tiny_qwen3_vl_model, qwen3=True)
    assert settings == qwen3.model.media.video
    assert (settings.min_pixels, settings.max_pixels, settings.patch_size) == (32 * 32 * 4, 32 * 32 * 128, 16)


@pytest.mark.parametrize("frames,height,width,cap,bounds", [
    (4, 64, 80, False, (4096, 131072)), (40, 480, 640, False, (4096, 131072)), (40, 480, 640, True, (4096, 131072)),
    (7, 1080, 1920, True, (131072, 786432)), (3, 20, 30, False, (4096, 131072)), (2, 10, 900, False, (4096, 131072)),
])
def test_video_size_choice_equals_hf_resize(hf_video_processor_class, monkeypatch, frames, height, width, cap,
                                            bounds):
    settings = VideoSettings(**{**VideoSettings.qwen3().as_dict(), "min_pixels": bounds[0], "max_pixels": bounds[1],
                                "cap_pixels_per_frame": cap})
    expected = hf_video_size(hf_video_processor_class, frames, height, width, settings, monkeypatch)
    assert resized_size(height, width, frames, settings) == expected


def test_a_single_frame_is_refused_as_hf_refuses_it(qwen3):
    with pytest.raises(InvalidArgument) as caught:
        chat_response(qwen3, chat(video_part(frames_of(1))))
    assert caught.value.reason == "VIDEO_PROCESSING_FAILED" and "temporal_factor" in str(caught.value)


# --------------------------------------------------------------------------- payloads and hashes


@pytest.mark.parametrize("payload", [METADATA, NONE])
def test_payload_modes_keep_ids_placeholders_and_hash(qwen3, payload):
    parts = (video_part(frames_of(3, 64, 64, seed=50), fps=2.0), image_part(picture(70, 50, seed=51)))
    full = chat_response(qwen3, chat(*parts)).generate_request
    light = chat_response(qwen3, chat(*parts, mm_payload=payload)).generate_request
    assert list(full.token_ids) == list(light.token_ids)
    for a, b in zip(full.mm_features.items, light.mm_features.items):
        assert a.mm_hash == b.mm_hash and a.placeholder == b.placeholder and not b.kwargs
        if payload == METADATA:
            assert {k: v.data for k, v in a.metadata.items()} == {k: v.data for k, v in b.metadata.items()}
        else:
            assert not b.metadata


def test_hash_covers_pixels_and_settings(qwen3):
    frames = frames_of(2, 64, 64, seed=60)

    def mm_hash(part, **fields):
        return chat_response(qwen3, chat(part, **fields)).generate_request.mm_features.items[0].mm_hash

    base = mm_hash(video_part(frames, fps=2.0))
    assert base == mm_hash(video_part(frames, fps=2.0))
    assert base != mm_hash(video_part(frames[::-1], fps=2.0))
    assert base != mm_hash(video_part(frames, fps=2.0), media_options=render_pb2.MediaOptions(max_pixels=32 * 32 * 8))
    image = picture(64, 64, seed=61)
    assert mm_hash(image_part(image)) != mm_hash(image_part(image),
                                                 media_options=render_pb2.MediaOptions(max_pixels=32 * 32 * 4))


def test_typed_timestamp_text_is_ordinary_text_but_typed_pads_are_refused(qwen3):
    typed = chat_response(qwen3, chat(text_part("<1.0 seconds> is a timestamp"), video_part(frames_of(2), fps=2.0)))
    assert len(typed.generate_request.mm_features.items) == 1
    with pytest.raises(InvalidArgument) as caught:
        chat_response(qwen3, chat(text_part("<|video_pad|>"), video_part(frames_of(2), fps=2.0)))
    assert caught.value.reason == "PLACEHOLDER_IN_TEXT"


# --------------------------------------------------------------------------- the stock processor


def test_stock_qwen3_vl_processor_agrees_where_torchvision_imports(qwen3, tiny_qwen3_vl_model):
    """transformers' own AutoProcessor (Qwen3VLProcessor with the real Qwen3VLVideoProcessor, which
    needs torchvision, and its torchvision image backend): ids, grids and is_embed positions equal;
    pixels within one uint8 level (torchvision's resize vs the PIL resize render does, see the README)."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen3_vl_model)
    frames, still = frames_of(5, 80, 64, seed=70), picture(64, 64, seed=71)
    response = chat_response(qwen3, chat(video_part(frames, fps=2.0), text_part("and"), image_part(still)))
    content = [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}]
    prompt = qwen3.model.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                       add_generation_prompt=True)
    hf = processor(text=[prompt], images=[still], videos=[np.stack([np.asarray(f) for f in frames])],
                   video_metadata=[{"total_num_frames": 5, "fps": 2.0, "frames_indices": list(range(5))}],
                   do_sample_frames=False, return_tensors="np")
    request = response.generate_request
    assert list(request.token_ids) == hf["input_ids"][0].tolist()
    video, image = request.mm_features.items
    assert to_numpy(video.metadata["video_grid_thw"]).tolist() == hf["video_grid_thw"].tolist()
    assert to_numpy(image.metadata["image_grid_thw"]).tolist() == hf["image_grid_thw"].tolist()
    assert embed_positions(video) == np.flatnonzero(hf["mm_token_type_ids"][0] == 2).tolist()
    assert embed_positions(image) == np.flatnonzero(hf["mm_token_type_ids"][0] == 1).tolist()
    level = (1 / 255) / 0.5  # one uint8 level after rescale and normalize (std 0.5)
    for item, key in ((image, "pixel_values"), (video, "pixel_values_videos")):
        assert np.abs(to_numpy(item.kwargs[key]) - hf[key]).max() <= level * 1.001
