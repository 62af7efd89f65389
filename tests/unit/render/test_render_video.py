"""Qwen2-VL video (frames) rendering: ids, pixel_values_videos and video_grid_thw equal the Hugging
Face computation (PIL image backend per frame + Qwen2VLVideoProcessor's own patchify / resize
code), frame padding, limits, hashes, payload modes, signing, engine admission and a model forward."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tito import signing
from tito.errors import InvalidArgument
from tito.tensors import to_numpy
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2
from tito_render.media.features import Signer
from tito_render.media.video import VideoSettings, load_video_settings, patchify, resized_size
from tito_render.renderer import Renderer, RenderLimits
from tito_render.convert import chat_response, model_info_to_proto

from hf_video import hf_video_rows, video_processor_class
from images import encoded, noise_image as picture, png
from renderers import load_renderer

TENSORS, METADATA, NONE = (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA,
                           multimodal_pb2.MM_PAYLOAD_NONE)
VIDEO = "messages[0].content_parts[0].video"


def frames_of(count: int, width: int = 100, height: int = 60, seed: int = 0) -> list[Image.Image]:
    return [picture(width, height, seed=seed + k) for k in range(count)]


def video_part(frames: list[Image.Image] | list[bytes], fps: float = 0.0) -> chat_pb2.ContentPart:
    data = [f if isinstance(f, bytes) else png(f) for f in frames]
    return chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=d) for d in data],
                                                           fps=fps))


def text_part(text: str) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(text=text)


def chat(*parts: chat_pb2.ContentPart, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))],
                                        **fields)


@pytest.fixture(scope="module")
def hf_video_processor_class():
    """transformers' Qwen2VLVideoProcessor class: its torch-only code (patchify, the size choice in
    resize) and class defaults serve as the reference."""
    return video_processor_class("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor")


def hf_reference(qwen: Renderer, frames: list[Image.Image], video_processor_class):
    """The HF computation: the model's own image processor (PIL backend) resizes, rescales and
    normalizes each frame to the video's size, then Qwen2VLVideoProcessor.patchify (HF's code)
    pads the frames and lays out the patches."""
    processor = qwen.model.media.image_processor
    settings = qwen.model.media.video
    height, width = resized_size(frames[0].height, frames[0].width, len(frames), settings)
    return hf_video_rows(processor, settings, frames, (height, width), video_processor_class)


def hf_ids(qwen: Renderer, dict_content: list[dict], grids: list[np.ndarray], image_grids=()) -> list[int]:
    """Qwen2VLProcessor's text side: template, each <|video_pad|> (<|image_pad|>) -> grid.prod() //
    merge**2 pads (via a stand-in token, as the processor does), then tokenize the whole text."""
    tokenizer = qwen.model.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": dict_content}], tokenize=False,
                                         add_generation_prompt=True)
    for marker, marker_grids in (("<|video_pad|>", grids), ("<|image_pad|>", image_grids)):
        for grid in marker_grids:
            text = text.replace(marker, "<|placeholder|>" * (int(np.prod(grid)) // 4), 1)
        text = text.replace("<|placeholder|>", marker.replace("|>", "|\0>"))
    return tokenizer(text.replace("|\0>", "|>"))["input_ids"]


# --------------------------------------------------------------------------- equality with HF


@pytest.mark.parametrize("count,size", [(2, (100, 60)), (3, (57, 311)), (4, (640, 480)), (1, (32, 32))])
def test_ids_and_pixel_values_videos_equal_hf(qwen, hf_video_processor_class, count, size):
    frames = frames_of(count, *size)
    response = chat_response(qwen, chat(text_part("Watch:"), video_part(frames, fps=2.0), text_part("What happens?")))
    rows, grid = hf_reference(qwen, frames, hf_video_processor_class)
    (item,) = response.generate_request.mm_features.items
    assert item.modality == multimodal_pb2.MODALITY_VIDEO
    pixels = to_numpy(item.kwargs["pixel_values_videos"])
    assert pixels.dtype == np.float32 and pixels.shape == rows.shape
    assert pixels.tobytes() == rows.tobytes()  # bit-identical
    assert to_numpy(item.metadata["video_grid_thw"]).tolist() == grid.tolist()
    assert to_numpy(item.metadata["video_grid_thw"]).dtype == np.int64
    assert list(item.kwargs) == ["pixel_values_videos"] and list(item.metadata) == ["video_grid_thw"]
    token_ids = list(response.generate_request.token_ids)
    content = [{"type": "text", "text": "Watch:"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    assert token_ids == hf_ids(qwen, content, [grid[0]])
    pad = qwen.model.media.video_token_id
    offset, length = item.placeholder.offset, item.placeholder.length
    assert length == int(grid.prod()) // 4 and len(item.placeholder.is_embed) == 0
    assert set(token_ids[offset:offset + length]) == {pad} and token_ids.count(pad) == length
    assert token_ids[offset - 1] == 1003 and token_ids[offset + length] == 1004  # vision start / end


def test_still_video_equals_image_processor_output(qwen):
    """Two identical frames: each row equals the image processor's row for that frame (which
    copies the frame over the temporal patch), so the pixel path is the image path, bit for bit."""
    frame = picture(130, 90, seed=3)
    response = chat_response(qwen, chat(video_part([frame, frame])))
    image_out = qwen.model.media.image_processor(images=[frame], return_tensors="np")
    (item,) = response.generate_request.mm_features.items
    assert to_numpy(item.kwargs["pixel_values_videos"]).tobytes() == image_out["pixel_values"].tobytes()
    assert to_numpy(item.metadata["video_grid_thw"]).tolist() == image_out["image_grid_thw"].tolist()


def test_patchify_equals_hf_with_odd_frame_count(hf_video_processor_class):
    settings = VideoSettings()
    video = np.random.RandomState(1).randn(5, 3, 56, 84).astype(np.float32)
    rows, grid = patchify(video, settings)
    hf_rows, t, h, w = hf_video_processor_class.patchify(None, torch.from_numpy(video)[None], 14, 2, 2)
    assert grid.tolist() == [[t, h, w]] == [[3, 4, 6]]
    assert rows.tobytes() == hf_rows[0].numpy().tobytes()


def test_frame_count_is_padded_by_repeating_the_last_frame(qwen):
    frames = frames_of(3, 84, 56)
    padded = chat_response(qwen, chat(video_part(frames)))
    explicit = chat_response(qwen, chat(video_part(frames + [frames[-1]])))
    (a,), (b,) = padded.generate_request.mm_features.items, explicit.generate_request.mm_features.items
    assert to_numpy(a.metadata["video_grid_thw"]).tolist() == [[2, 4, 6]]
    assert to_numpy(a.kwargs["pixel_values_videos"]).tobytes() == to_numpy(b.kwargs["pixel_values_videos"]).tobytes()
    assert a.mm_hash != b.mm_hash  # 3 frames are not 4 frames, even if the tensors agree


def test_video_size_choice_equals_hf_resize(hf_video_processor_class, monkeypatch):
    """resized_size (with and without cap_pixels_per_frame) equals the size Qwen2VLVideoProcessor.resize
    hands to the torchvision resize."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    chosen = {}
    monkeypatch.setattr(TorchvisionBackend, "resize",
                        lambda self, image, size, resample, **kw: chosen.setdefault("size", (size.height, size.width)))
    processor = object.__new__(hf_video_processor_class)  # no __init__: it would need torchvision
    for frames, (height, width), cap, bounds in [(40, (480, 640), True, (3136, 50176)),
                                                 (40, (480, 640), True, (100352, 602112)),
                                                 (400, (1080, 1920), True, (100352, 602112)),
                                                 (6, (1080, 1920), False, (100352, 602112)),
                                                 (2, (20, 30), False, (3136, 50176))]:
        chosen.clear()
        hf_video_processor_class.resize(processor, torch.zeros(1, 1, 1, 1, 1).expand(1, frames, 3, height, width),
                                        SizeDict(shortest_edge=bounds[0], longest_edge=bounds[1]), 3, 28, 2, cap)
        settings = VideoSettings(min_pixels=bounds[0], max_pixels=bounds[1], cap_pixels_per_frame=cap)
        assert resized_size(height, width, frames, settings) == chosen["size"]


def test_settings_defaults_equal_hf_class_defaults(hf_video_processor_class):
    cls, defaults = hf_video_processor_class, VideoSettings()
    assert (defaults.min_pixels, defaults.max_pixels) == (cls.size["shortest_edge"], cls.size["longest_edge"])
    assert (defaults.patch_size, defaults.temporal_patch_size, defaults.merge_size) == (
        cls.patch_size, cls.temporal_patch_size, cls.merge_size)
    assert defaults.resample == cls.resample and list(defaults.image_mean) == list(cls.image_mean)
    assert list(defaults.image_std) == list(cls.image_std) and defaults.max_video_tokens == cls.max_video_tokens
    assert cls.cap_pixels_per_frame is None and defaults.cap_pixels_per_frame is False  # None acts as False


def test_settings_follow_transformers_lookup_order(tmp_path):
    image = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 50176,
             "size": {"shortest_edge": 3136, "longest_edge": 50176}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image))
    assert (load_video_settings(tmp_path).min_pixels, load_video_settings(tmp_path).max_pixels) == (3136, 50176)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"temporal_patch_size": 2}))
    settings = load_video_settings(tmp_path)  # a video config without a size: the class defaults
    assert (settings.min_pixels, settings.max_pixels) == (128 * 28 * 28, 28 * 28 * 768)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"max_pixels": 99999,
                                                                                    "fps": 2}}))
    assert load_video_settings(tmp_path).max_pixels == 99999  # nested processor config first


def test_media_options_apply_to_videos(qwen):
    frames = frames_of(2, 640, 480)
    default = chat_response(qwen, chat(video_part(frames)))
    small = chat_response(qwen, chat(video_part(frames), media_options=render_pb2.MediaOptions(max_pixels=28 * 28 * 4)))
    (a,), (b,) = default.generate_request.mm_features.items, small.generate_request.mm_features.items
    assert to_numpy(a.metadata["video_grid_thw"]).tolist() == [[1, 12, 18]]
    assert to_numpy(b.metadata["video_grid_thw"]).tolist() == [[1, 2, 4]]
    assert a.mm_hash != b.mm_hash


def test_images_and_videos_interleave_in_prompt_order(qwen):
    image, frames = picture(64, 64, seed=9), frames_of(2, 56, 56, seed=20)
    response = chat_response(qwen, chat(
        video_part(frames), text_part("then"), chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(image))),
        text_part("and"), video_part(frames[::-1])))
    items = response.generate_request.mm_features.items
    assert [i.modality for i in items] == [multimodal_pb2.MODALITY_VIDEO, multimodal_pb2.MODALITY_IMAGE,
                                           multimodal_pb2.MODALITY_VIDEO]
    assert items[0].placeholder.offset < items[1].placeholder.offset < items[2].placeholder.offset
    grids = [to_numpy(items[0].metadata["video_grid_thw"])[0], to_numpy(items[2].metadata["video_grid_thw"])[0]]
    image_grid = to_numpy(items[1].metadata["image_grid_thw"])[0]
    content = [{"type": "video"}, {"type": "text", "text": "then"}, {"type": "image"}, {"type": "text", "text": "and"},
               {"type": "video"}]
    assert list(response.generate_request.token_ids) == hf_ids(qwen, content, grids, [image_grid])


# --------------------------------------------------------------------------- hashes, payloads, signing


def test_hash_covers_frames_order_fps_and_settings(qwen):
    frames = frames_of(3, 80, 60)

    def mm_hash(part, **fields):
        return chat_response(qwen, chat(part, **fields)).generate_request.mm_features.items[0].mm_hash

    base = mm_hash(video_part(frames, fps=2))
    data_urls = chat_pb2.ContentPart(video=chat_pb2.VideoFrames(fps=2, frames=[
        chat_pb2.ImageSource(url="data:image/png;base64," + base64.b64encode(png(f)).decode()) for f in frames]))
    webp = [encoded(f, "WEBP", lossless=True) for f in frames]
    assert mm_hash(data_urls) == base == mm_hash(video_part(webp, fps=2))  # same pixels, other encodings
    assert mm_hash(video_part(frames[::-1], fps=2)) != base
    assert mm_hash(video_part(frames, fps=4)) != base
    assert mm_hash(video_part(frames, fps=2), media_options=render_pb2.MediaOptions(max_pixels=3136 * 2)) != base
    assert mm_hash(video_part(frames, fps=2), media_options=render_pb2.MediaOptions(max_pixels=50176)) == base
    image_hash = chat_response(qwen, chat(chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(frames[0])))))
    assert mm_hash(video_part(frames[:1], fps=2)) != image_hash.generate_request.mm_features.items[0].mm_hash


def test_streamed_hash_equals_hash_of_all_frames(qwen):
    from tito_render.media.hashing import video_hash

    frames = frames_of(3, 70, 50)
    (item,) = chat_response(qwen, chat(video_part(frames, fps=1.5))).generate_request.mm_features.items
    assert item.mm_hash == video_hash(frames, 1.5, "qwen2_vl", qwen.model.media.video.hash_options())


def test_payload_modes_same_ids_and_placeholders(qwen):
    frames = frames_of(4, 120, 90)
    responses = {mode: chat_response(qwen, chat(video_part(frames), mm_payload=mode))
                 for mode in (TENSORS, METADATA, NONE)}
    ids = {mode: list(r.generate_request.token_ids) for mode, r in responses.items()}
    assert ids[TENSORS] == ids[METADATA] == ids[NONE]
    items = {mode: r.generate_request.mm_features.items[0] for mode, r in responses.items()}
    assert len({(i.placeholder.offset, i.placeholder.length, i.mm_hash, i.modality) for i in items.values()}) == 1
    assert list(items[TENSORS].kwargs) == ["pixel_values_videos"] and not items[METADATA].kwargs
    assert to_numpy(items[METADATA].metadata["video_grid_thw"]).tolist() == \
        to_numpy(items[TENSORS].metadata["video_grid_thw"]).tolist() == [[2, 6, 8]]
    assert not items[NONE].kwargs and not items[NONE].metadata


def test_signed_video_item_verifies(tiny_vl_model):
    key = b"k" * 32
    renderer = load_renderer(tiny_vl_model, signer=Signer(key, "key-1"))
    (item,) = chat_response(renderer, chat(video_part(frames_of(2, 56, 56)))).generate_request.mm_features.items
    assert item.auth_key_id == "key-1" and signing.verify_item(item, {"key-1": key})
    item.kwargs["pixel_values_videos"].data = bytes(len(item.kwargs["pixel_values_videos"].data))
    assert not signing.verify_item(item, {"key-1": key})


def test_cache_reuses_a_processed_video(tiny_vl_model):
    renderer = load_renderer(tiny_vl_model, RenderLimits(media_cache_bytes=16 << 20))
    request = chat(video_part(frames_of(2, 84, 56)))
    first = chat_response(renderer, request)
    assert renderer.image_cache.misses >= 1 and renderer.image_cache.hits == 0
    second = chat_response(renderer, request)
    assert second.generate_request.mm_features == first.generate_request.mm_features
    assert renderer.image_cache.hits == 1
    chat_response(renderer, chat(video_part(frames_of(2, 84, 56)[::-1])))
    assert renderer.image_cache.hits == 1  # another order is another video


# --------------------------------------------------------------------------- limits and errors


def render_error(renderer: Renderer, request) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        chat_response(renderer, request)
    return err.value


@pytest.fixture(scope="module")
def strict(tiny_vl_model) -> Renderer:
    from tito_render.media.loader import MediaPolicy

    limits = RenderLimits(media=MediaPolicy(max_image_pixels=200 * 200), max_images_per_request=5,
                          max_video_frames=4)
    return load_renderer(tiny_vl_model, limits)


def test_too_many_video_frames_names_the_first_frame_over(strict):
    err = render_error(strict, chat(video_part(frames_of(5, 30, 30))))
    assert (err.reason, err.field) == ("TOO_MANY_VIDEO_FRAMES", f"{VIDEO}.frames[4]")
    assert err.metadata == {"limit": "max_video_frames", "max": "4"} and "--max-video-frames" in err.message


def test_frames_count_toward_images_per_request(strict):
    image = chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(picture(30, 30))))
    err = render_error(strict, chat(image, image, video_part(frames_of(4, 30, 30))))
    assert (err.reason, err.field) == ("TOO_MANY_IMAGES", "messages[0].content_parts[2].video.frames[3]")


def test_each_frame_is_decoded_with_the_image_limits(strict):
    frames = [png(picture(30, 30)), png(picture(300, 300))]
    err = render_error(strict, chat(video_part(frames)))
    assert (err.reason, err.field) == ("IMAGE_TOO_MANY_PIXELS", f"{VIDEO}.frames[1].data")
    err = render_error(strict, chat(video_part([png(picture(30, 30)), b"not an image"])))
    assert (err.reason, err.field) == ("CORRUPT_IMAGE", f"{VIDEO}.frames[1].data")


@pytest.mark.parametrize("part,reason,field", [
    (video_part([picture(30, 30), picture(31, 30)]), "VIDEO_FRAME_SIZE_MISMATCH", f"{VIDEO}.frames[1]"),
    (chat_pb2.ContentPart(video=chat_pb2.VideoFrames()), "", f"{VIDEO}.frames"),
    (video_part([picture(30, 30)], fps=-1), "INVALID_VIDEO", f"{VIDEO}.fps"),
    (video_part([picture(1000, 4)] * 2), "VIDEO_PROCESSING_FAILED", VIDEO),  # aspect ratio > 200
])
def test_bad_videos_are_field_named_and_the_renderer_keeps_working(qwen, part, reason, field):
    err = render_error(qwen, chat(part))
    assert field in [err.field, *(v.field for v in err.violations)]
    if reason:
        assert err.reason == reason
    assert chat_response(qwen, chat(video_part(frames_of(2, 56, 56)))).generate_request.mm_features.items


def test_typed_video_pad_is_refused(qwen):
    err = render_error(qwen, chat(video_part(frames_of(2, 56, 56)), text_part("<|video_pad|>")))
    assert err.reason == "PLACEHOLDER_IN_TEXT"


def test_gemma3_video_is_unsupported_modality(tiny_interleaved_vl_model):
    gemma = load_renderer(tiny_interleaved_vl_model)
    err = render_error(gemma, chat(text_part("see"), video_part(frames_of(2, 30, 30))))
    assert (err.reason, err.field) == ("UNSUPPORTED_MODALITY", "messages[0].content_parts[1].video")
    assert "video" in err.message
    assert list(model_info_to_proto(gemma).modalities) == [multimodal_pb2.MODALITY_IMAGE]


# --------------------------------------------------------------------------- engine side


def test_engine_admits_the_item_and_the_model_runs_forward(qwen, tiny_vl_model):
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from tito_engine.multimodal.features import FeaturePolicy, validate_mm_features

    from tito_engine.multimodal.specs import multimodal_spec_from_config
    from tito_engine.service.convert import media_from_proto

    frames = frames_of(3, 84, 112)
    response = chat_response(qwen, chat(text_part("Watch:"), video_part(frames), text_part("ok?")))
    request = response.generate_request
    config = AutoConfig.from_pretrained(str(tiny_vl_model))
    spec = multimodal_spec_from_config(config, "tiny")
    validated = validate_mm_features(list(request.token_ids), media_from_proto(request), spec, FeaturePolicy())
    (admitted,) = validated.items
    assert admitted.modality == "video"
    item = request.mm_features.items[0]
    positions = list(range(item.placeholder.offset, item.placeholder.offset + item.placeholder.length))
    assert list(admitted.embed_positions) == positions

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_vl_model)).eval()
    input_ids = torch.tensor([list(request.token_ids)])
    types_ = torch.zeros_like(input_ids)
    types_[0, positions] = 2
    pixels = torch.tensor(to_numpy(item.kwargs["pixel_values_videos"]))
    grid = torch.tensor(to_numpy(item.metadata["video_grid_thw"]))
    with torch.inference_mode():
        out = model(input_ids=input_ids, pixel_values_videos=pixels, video_grid_thw=grid, mm_token_type_ids=types_)
    assert out.logits.shape[:2] == (1, len(request.token_ids)) and torch.isfinite(out.logits).all()
    # the encoder gives exactly one row per placeholder position
    with torch.inference_mode():
        rows = model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid, return_dict=True)
    assert sum(r.shape[0] for r in rows.pooler_output) == len(positions)


# --------------------------------------------------------------------------- Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen25(tiny_qwen2_5_vl_model) -> Renderer:
    return load_renderer(tiny_qwen2_5_vl_model)


class StandInVideoProcessor:
    """What Qwen2_5_VLProcessor needs of its video processor (the real one imports torchvision):
    the pixels from `hf_reference` (HF's PIL-backend frame math + HF's patchify) and the video
    metadata from HF's own `make_batched_metadata` (whose sampled_fps defaults unknown fps to 24)."""

    temporal_patch_size = 2
    merge_size = 2

    def __init__(self, renderer: Renderer, video_processor_class):
        self.renderer, self.video_processor_class = renderer, video_processor_class

    def __call__(self, videos, video_metadata=None, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_metadata

        outputs = [hf_reference(self.renderer, list(frames), self.video_processor_class) for frames in videos]
        metadata = make_batched_metadata([np.stack([np.asarray(f) for f in frames]) for frames in videos],
                                         video_metadata)
        return BatchFeature({"pixel_values_videos": np.concatenate([rows for rows, _ in outputs]),
                             "video_grid_thw": np.concatenate([grid for _, grid in outputs]),
                             "video_metadata": metadata})


def hf_qwen2_5_vl_processor(renderer: Renderer, video_processor_class):
    """transformers' Qwen2_5_VLProcessor (its text expansion, mm_token_type_ids and
    second_per_grid_ts code), built around the model's image processor and tokenizer and the
    stand-in video processor; its __init__ is skipped (it looks the video processor class up, which
    needs torchvision)."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    processor = object.__new__(Qwen2_5_VLProcessor)
    processor.image_processor = renderer.model.media.image_processor
    processor.tokenizer = renderer.model.tokenizer
    processor.video_processor = StandInVideoProcessor(renderer, video_processor_class)
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id, processor.video_token_id = 1005, 1006
    return processor


@pytest.mark.parametrize("fps", [2.0, 0.0, 5.0])
def test_qwen2_5_vl_video_and_image_equal_hf_processor(qwen25, hf_video_processor_class, fps):
    frames = frames_of(5, 90, 70, seed=20)
    still = picture(100, 60, seed=30)
    response = chat_response(qwen25, chat(text_part("Clip:"), video_part(frames, fps=fps),
                                       chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(still))),
                                       text_part("Same scene?")))
    content = [{"type": "text", "text": "Clip:"}, {"type": "video"}, {"type": "image"},
               {"type": "text", "text": "Same scene?"}]
    text = qwen25.model.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
    metadata = [{"total_num_frames": 5, "fps": fps, "frames_indices": list(range(5))}] if fps else None
    hf = hf_qwen2_5_vl_processor(qwen25, hf_video_processor_class)(
        text=[text], images=[still], videos=[frames], video_metadata=metadata, return_tensors="np")
    request = response.generate_request
    assert list(request.token_ids) == hf["input_ids"][0].tolist()
    video, image = request.mm_features.items
    assert to_numpy(video.kwargs["pixel_values_videos"]).tobytes() == hf["pixel_values_videos"].tobytes()
    assert to_numpy(video.metadata["video_grid_thw"]).tolist() == hf["video_grid_thw"].tolist()
    seconds = to_numpy(video.metadata["second_per_grid_ts"])
    assert seconds.dtype == np.float32 and seconds.shape == (1,)
    # HF hands the value to the model as a float32 tensor: equal in float32, 2 / (fps or 24).
    assert seconds.tolist() == np.asarray(hf["second_per_grid_ts"], dtype=np.float32).tolist()
    assert seconds[0] == np.float32(2 / (fps or 24))
    assert to_numpy(image.kwargs["pixel_values"]).tobytes() == hf["pixel_values"].tobytes()
    assert to_numpy(image.metadata["image_grid_thw"]).tolist() == hf["image_grid_thw"].tolist()
    assert list(image.metadata) == ["image_grid_thw"]  # images have no time axis
    # Placeholder ranges are exactly the runs HF's mm_token_type_ids marks (2 video, 1 image).
    types = hf["mm_token_type_ids"][0]
    for item, type_id in ((video, 2), (image, 1)):
        marked = np.flatnonzero(types == type_id).tolist()
        assert marked == list(range(item.placeholder.offset, item.placeholder.offset + item.placeholder.length))


def test_qwen2_5_vl_video_fps_changes_hash_and_seconds_not_pixels(qwen25):
    frames = frames_of(2, 60, 60, seed=40)
    slow, fast = (chat_response(qwen25, chat(video_part(frames, fps=fps))).generate_request.mm_features.items[0]
                  for fps in (1.0, 4.0))
    assert slow.mm_hash != fast.mm_hash
    assert slow.kwargs["pixel_values_videos"].data == fast.kwargs["pixel_values_videos"].data
    assert to_numpy(slow.metadata["second_per_grid_ts"]).tolist() == [2.0]
    assert to_numpy(fast.metadata["second_per_grid_ts"]).tolist() == [0.5]
    metadata_only = chat_response(qwen25, chat(video_part(frames, fps=4.0), mm_payload=METADATA))
    (item,) = metadata_only.generate_request.mm_features.items
    assert not item.kwargs and to_numpy(item.metadata["second_per_grid_ts"]).tolist() == [0.5]


def test_qwen2_vl_videos_carry_no_seconds(qwen):
    (item,) = chat_response(qwen, chat(video_part(frames_of(2, 60, 60), fps=4.0))).generate_request.mm_features.items
    assert list(item.metadata) == ["video_grid_thw"]
