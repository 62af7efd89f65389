"""Per-model-family media adapters: the only model-specific part of media handling.

An adapter knows, for one family of vision-language models:
- which text the chat template renders for one image (`image_marker`) and what the Hugging Face
  processor replaces it with (`span_text`), i.e. the item's placeholder span: its token ids and
  which positions take encoder output (`is_embed`, when the span interleaves structural tokens);
- which processor outputs are encoder inputs (kwargs, e.g. pixel_values) and which are small
  metadata the engine needs even without them (e.g. image_grid_thw);
- which processor options a request may tune (media_options), and their effective values (which
  go into the content hash).

The model's own Hugging Face image processor (AutoImageProcessor, the PIL backend) does the pixel
work, so tensors are bit-identical to the Hugging Face path. Domain code: no grpc.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tito.errors import InvalidArgument, Violations

from tito_render.domain import MediaOptions, Modality
from tito_render.media import video as video_math
from tito_render.media.video import VideoSettings

log = logging.getLogger(__name__)

#: PIL resampling filters (NEAREST=0 ... LANCZOS=1, BILINEAR=2, BICUBIC=3, BOX=4, HAMMING=5).
_RESAMPLE_VALUES = range(0, 6)


@dataclass
class ProcessedImage:
    """One image, processed: its placeholder span and its tensors."""

    #: Text that replaces the image marker in the rendered prompt (what the HF processor inserts).
    span_text: str
    #: Token ids of the placeholder span (the part of span_text the item's range covers).
    span_token_ids: tuple[int, ...]
    #: Per-position embed mask; None when every position of the span takes encoder output.
    is_embed: tuple[bool, ...] | None
    #: Encoder inputs (empty when tensors were not asked for).
    kwargs: dict[str, np.ndarray] = field(default_factory=dict)
    #: Small per-item tensors the engine needs even without kwargs.
    metadata: dict[str, np.ndarray] = field(default_factory=dict)
    #: The item's modality (IMAGE or VIDEO).
    modality: int = Modality.IMAGE


def _int_in(low: int, high: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        if value < low or (high is not None and value > high):
            return f"must be in [{low}, {high if high is not None else 'inf'}], got {value}"
        return None
    return check


class MediaAdapter:
    """Base: behaviour shared by every family. Subclasses set the class attributes and `process`."""

    family = ""
    #: Request-tunable processor kwargs (in media_options.processor_kwargs) and their checks.
    tunable: dict[str, Callable[[Any], str | None]] = {"resample": _int_in(0, 5)}
    #: Whether media_options.min_pixels / max_pixels apply to this family.
    has_pixel_bounds = False

    def __init__(self, image_processor: Any, tokenizer: Any, model_config: dict[str, Any],
                 processor_config: dict[str, Any]) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.processor_config = processor_config
        self.image_marker = ""
        #: Text the template renders for one video part ("" = the family takes no video).
        self.video_marker = ""
        #: The video processor's settings (None = the family takes no video).
        self.video: VideoSettings | None = None
        self.reserved_token_ids: frozenset[int] = frozenset()
        self._default_options: dict[str, Any] | None = None

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no token {token!r}")
        return int(token_id)

    # ---------------------------------------------------------------- options
    def call_kwargs(self, options: MediaOptions, max_image_pixels: int) -> dict[str, Any]:
        """Validate media_options and turn them into image processor call kwargs."""
        from tito_render.messages import request_struct  # local: messages imports nothing from media

        violations = Violations()
        requested = (request_struct(options.processor_kwargs, "media_options.processor_kwargs")
                     if options.processor_kwargs is not None else {})
        kwargs: dict[str, Any] = {}
        for key, value in requested.items():
            check = self.tunable.get(key)
            if check is None:
                allowed = ", ".join(sorted(self.tunable)) or "none"
                violations.add(f"media_options.processor_kwargs.{key}",
                               f"{key!r} is not a tunable option of the {self.family} image processor "
                               f"(tunable: {allowed})")
                continue
            problem = check(value)
            if problem:
                violations.add(f"media_options.processor_kwargs.{key}", f"{key} {problem}")
            kwargs[key] = value
        for name in ("min_pixels", "max_pixels"):
            value = getattr(options, name)
            if value is None:
                continue
            if not self.has_pixel_bounds:
                violations.add(f"media_options.{name}", f"the {self.family} image processor has a fixed input "
                                                        f"size; {name} does not apply")
            elif not 1 <= value <= max_image_pixels:
                violations.add(f"media_options.{name}", f"{name}={value} must be in [1, {max_image_pixels}] "
                                                        f"(max_image_pixels, --max-image-pixels)")
            else:
                kwargs[name] = value
        violations.raise_if_any(reason="INVALID_MEDIA_OPTIONS")
        return self.normalise_kwargs(kwargs)

    def normalise_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    def effective_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The processor settings that shape the tensors, defaults overridden by `kwargs` (hashed)."""
        if self._default_options is None:
            names = set(getattr(self.image_processor, "valid_kwargs", dict).__annotations__)
            names -= {"return_tensors", "device", "data_format", "input_data_format", "disable_grouping"}
            self._default_options = {k: v for k, v in self.image_processor.to_dict().items() if k in names}
        options = {**self._default_options, **kwargs}
        return json.loads(json.dumps(options, default=str))  # plain JSON types: tuples -> lists, enums -> str

    def video_settings(self, options: MediaOptions) -> VideoSettings:
        """The video settings for this request: media_options (checked by `call_kwargs`, which runs
        first) override min/max_pixels and resample as they do for images."""
        if self.video is None:
            raise ValueError(f"the {self.family} adapter takes no video")  # checked by the caller: a bug
        from tito_render.messages import request_struct

        requested = (request_struct(options.processor_kwargs, "media_options.processor_kwargs")
                     if options.processor_kwargs is not None else {})
        settings = self.video.with_overrides(options.min_pixels, options.max_pixels, requested.get("resample"))
        if settings.min_pixels > settings.max_pixels:
            raise InvalidArgument(f"min_pixels={settings.min_pixels} exceeds max_pixels={settings.max_pixels} "
                                  f"(the video processor's bounds with media_options applied)",
                                  reason="INVALID_MEDIA_OPTIONS", field="media_options.min_pixels")
        return settings

    # ------------------------------------------------------------- processing
    def process_video(self, num_frames: int, frame_size: tuple[int, int], resized_frames: list[Image.Image] | None,
                      settings: VideoSettings, fps: float = 0.0) -> ProcessedImage:
        raise NotImplementedError

    def process(self, image: Image.Image, kwargs: dict[str, Any], with_tensors: bool,
                pixels: np.ndarray | None = None) -> ProcessedImage:
        """`image` is RGB; `pixels`, when given, is `hashing.rgb_pixels(image)` (already packed)."""
        raise NotImplementedError

    def run_processor(self, image: Image.Image, kwargs: dict[str, Any],
                      pixels: np.ndarray | None = None) -> dict[str, np.ndarray]:
        if pixels is None:
            out = self.image_processor(images=[image], return_tensors="np", **kwargs)
        else:
            # The same pixels the PIL path would see, without its copies: for an RGB image the PIL
            # backend's convert_to_rgb is `image.convert("RGB")` then `np.array(...)`, i.e. exactly
            # `pixels` (H, W, C), which it then views channels-first as it does here.
            out = self.image_processor(images=[pixels], return_tensors="np", do_convert_rgb=False,
                                       input_data_format="channels_last", **kwargs)
        return {k: np.asarray(v) for k, v in out.items()}


#: The frame rate HF's video metadata assumes when none is known (`VideoMetadata.sampled_fps`).
DEFAULT_VIDEO_FPS = 24.0


class Qwen2VLAdapter(MediaAdapter):
    """Qwen2-VL / Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`, the pad repeated once
    per merged patch (grid_thw.prod() // merge_size**2); every span position takes encoder output.
    kwargs: pixel_values (this item's grid_thw.prod() flattened patches); metadata: image_grid_thw
    [1, 3] int64 (concatenating the items' tensors along dim 0 gives the processor's batch).
    Qwen2.5-VL videos also carry metadata second_per_grid_ts [1] float32 (see `process_video`)."""

    family = "qwen2_vl"
    tunable = {"resample": _int_in(0, 5)}
    has_pixel_bounds = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        image_id = self.model_config.get("image_token_id")
        video_id = self.model_config.get("video_token_id")
        self.image_marker = (self.tokenizer.convert_ids_to_tokens(image_id) if isinstance(image_id, int)
                             else "<|image_pad|>")
        self.image_token_id = self.token_id(self.image_marker)
        reserved = {self.image_token_id}
        self.video_token_id: int | None = None
        if isinstance(video_id, int):
            self.video_token_id = video_id
        else:
            try:
                self.video_token_id = self.token_id("<|video_pad|>")
            except ValueError:
                pass
        if self.video_token_id is not None:
            reserved.add(self.video_token_id)
            self.video_marker = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
        self.reserved_token_ids = frozenset(reserved)
        processor = self.image_processor
        self.patch_size = int(processor.patch_size)
        self.merge_size = int(processor.merge_size)
        # Qwen2.5-VL spaces the time axis of a video's M-RoPE by the seconds each grid step spans.
        self.timed_video = self.model_config.get("model_type") == "qwen2_5_vl"

    def normalise_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 takes min/max_pixels as size={"shortest_edge", "longest_edge"}.
        min_pixels, max_pixels = kwargs.pop("min_pixels", None), kwargs.pop("max_pixels", None)
        if min_pixels is not None or max_pixels is not None:
            size = dict(self.image_processor.size)
            size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
            size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
            if size["shortest_edge"] > size["longest_edge"]:
                raise InvalidArgument(f"min_pixels={size['shortest_edge']} exceeds max_pixels={size['longest_edge']}",
                                      reason="INVALID_MEDIA_OPTIONS", field="media_options.min_pixels")
            kwargs["size"] = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
        return kwargs

    def grid_thw(self, image: Image.Image, kwargs: dict[str, Any]) -> np.ndarray:
        """image_grid_thw without touching the pixels (what the processor's resize would choose)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        size = kwargs.get("size") or self.image_processor.size
        width, height = image.size
        resized_h, resized_w = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return np.array([[1, resized_h // self.patch_size, resized_w // self.patch_size]], dtype=np.int64)

    def process(self, image: Image.Image, kwargs: dict[str, Any], with_tensors: bool,
                pixels: np.ndarray | None = None) -> ProcessedImage:
        tensors: dict[str, np.ndarray] = {}
        if with_tensors:
            out = self.run_processor(image, kwargs, pixels)
            grid = out["image_grid_thw"].astype(np.int64).reshape(1, 3)
            tensors["pixel_values"] = out["pixel_values"]
        else:
            grid = self.grid_thw(image, kwargs)
        count = int(grid.prod()) // (self.merge_size ** 2)
        return ProcessedImage(span_text=self.image_marker * count, span_token_ids=(self.image_token_id,) * count,
                              is_embed=None, kwargs=tensors, metadata={"image_grid_thw": grid})


    def process_video(self, num_frames: int, frame_size: tuple[int, int], resized_frames: list[Image.Image] | None,
                      settings: VideoSettings, fps: float = 0.0) -> ProcessedImage:
        """`<|video_pad|>` x grid_thw.prod() // merge_size**2; kwargs pixel_values_videos (from
        `resized_frames`, when given), metadata video_grid_thw [1, 3] (media/video.py:
        Qwen2VLVideoProcessor's math without torchvision). `frame_size` is (width, height).
        Qwen2.5-VL adds metadata second_per_grid_ts [1] float32 = temporal_patch_size / fps, as
        Qwen2_5_VLProcessor computes it (fps 0, unknown, is HF's default of 24)."""
        width, height = frame_size
        grid = video_math.video_grid_thw(num_frames, height, width, settings)
        tensors: dict[str, np.ndarray] = {}
        if resized_frames is not None:
            out = video_math.process_resized_video(resized_frames, settings)
            if out["video_grid_thw"].tolist() != grid.tolist():
                raise RuntimeError(f"video grid {out['video_grid_thw'].tolist()} != {grid.tolist()}")  # a bug
            tensors["pixel_values_videos"] = out["pixel_values_videos"]
        count = int(grid.prod()) // (settings.merge_size ** 2)
        metadata = {"video_grid_thw": grid}
        if self.timed_video:
            seconds = settings.temporal_patch_size / (fps or DEFAULT_VIDEO_FPS)
            metadata["second_per_grid_ts"] = np.array([seconds], dtype=np.float32)
        return ProcessedImage(span_text=self.video_marker * count, span_token_ids=(self.video_token_id,) * count,
                              is_embed=None, kwargs=tensors, metadata=metadata, modality=Modality.VIDEO)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen3-VL: images as Qwen2-VL's (16-pixel patches); a video's span is what
    Qwen3VLProcessor puts in place of the template's `<|video_pad|>`: per temporal patch k,
    `<{t_k:.1f} seconds>` + `<|vision_start|>` + `<|video_pad|>` x (h*w // merge**2) +
    `<|vision_end|>`, t_k the patch's timestamp (`video.frame_timestamps`; fps 0, unknown, is HF's
    default of 24). The placeholder range covers the whole replacement, timestamp text and
    per-frame markers included; `is_embed` is true exactly at the `<|video_pad|>` positions, which
    take the video's encoder rows in order. The template's own `<|vision_start|>` /
    `<|vision_end|>` around it stay outside the range. Metadata: video_grid_thw [1, 3] (frames
    are separated by their timestamps, so the engine reads the per-frame runs from is_embed)."""

    family = "qwen3_vl"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.timed_video = False
        self.vision_start_token_id = self.token_id("<|vision_start|>")
        self.vision_end_token_id = self.token_id("<|vision_end|>")
        self.vision_start = self.tokenizer.convert_ids_to_tokens(self.vision_start_token_id)
        self.vision_end = self.tokenizer.convert_ids_to_tokens(self.vision_end_token_id)

    def process_video(self, num_frames: int, frame_size: tuple[int, int], resized_frames: list[Image.Image] | None,
                      settings: VideoSettings, fps: float = 0.0) -> ProcessedImage:
        base = super().process_video(num_frames, frame_size, resized_frames, settings, fps)
        grid_t, grid_h, grid_w = (int(v) for v in base.metadata["video_grid_thw"][0])
        per_frame = grid_h * grid_w // settings.merge_size ** 2
        text: list[str] = []
        ids: list[int] = []
        mask: list[bool] = []
        for seconds in video_math.frame_timestamps(num_frames, fps or DEFAULT_VIDEO_FPS,
                                                   settings.temporal_patch_size)[:grid_t]:
            stamp = f"<{seconds:.1f} seconds>"
            # Between special tokens, a timestamp tokenizes alone (as vLLM's replacement does it).
            stamp_ids = self.tokenizer.encode(stamp, add_special_tokens=False)
            text.append(stamp + self.vision_start + self.video_marker * per_frame + self.vision_end)
            ids.extend([*stamp_ids, self.vision_start_token_id, *([self.video_token_id] * per_frame),
                        self.vision_end_token_id])
            mask.extend([False] * (len(stamp_ids) + 1) + [True] * per_frame + [False])
        return ProcessedImage(span_text="".join(text), span_token_ids=tuple(ids), is_embed=tuple(mask),
                              kwargs=base.kwargs, metadata=base.metadata, modality=Modality.VIDEO)


class Gemma3Adapter(MediaAdapter):
    """Gemma3: the template's `<start_of_image>` becomes `\\n\\n<start_of_image>` + image_seq_length x
    `<image_soft_token>` + `<end_of_image>\\n\\n` (as Gemma3Processor does). The placeholder range is
    `<start_of_image>` .. `<end_of_image>` (the newlines are ordinary text that BPE may merge with
    the neighbours); is_embed is true exactly at the soft tokens. kwargs: pixel_values
    [1, 3, H, W]; no metadata. Pan-and-scan (extra crop spans) is not supported."""

    family = "gemma3"
    tunable = {"resample": _int_in(0, 5)}

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        tokenizer = self.tokenizer
        self.boi_token = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
        self.eoi_token = getattr(tokenizer, "eoi_token", None) or "<end_of_image>"
        self.soft_token = getattr(tokenizer, "image_token", None) or "<image_soft_token>"
        self.tokens_per_image = int(self.processor_config.get("image_seq_length")
                                    or self.model_config.get("mm_tokens_per_image") or 256)
        boi, eoi, soft = (self.token_id(t) for t in (self.boi_token, self.eoi_token, self.soft_token))
        self.image_marker = self.boi_token
        self.reserved_token_ids = frozenset({boi, eoi, soft})
        self._span_ids = (boi,) + (soft,) * self.tokens_per_image + (eoi,)
        self._is_embed = (False,) + (True,) * self.tokens_per_image + (False,)
        self._span_text = f"\n\n{self.boi_token}{self.soft_token * self.tokens_per_image}{self.eoi_token}\n\n"

    def process(self, image: Image.Image, kwargs: dict[str, Any], with_tensors: bool,
                pixels: np.ndarray | None = None) -> ProcessedImage:
        tensors: dict[str, np.ndarray] = {}
        if with_tensors:
            out = self.run_processor(image, {**kwargs, "do_pan_and_scan": False}, pixels)
            tensors["pixel_values"] = out["pixel_values"]
        return ProcessedImage(span_text=self._span_text, span_token_ids=self._span_ids, is_embed=self._is_embed,
                              kwargs=tensors)


#: Image processor class (without the Fast/Pil backend suffix) -> adapter.
ADAPTERS: dict[str, type[MediaAdapter]] = {
    "Qwen2VLImageProcessor": Qwen2VLAdapter,
    "Gemma3ImageProcessor": Gemma3Adapter,
}


#: Models whose videos render processes (their video processor's math is in media/video.py).
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: model_type -> adapter, where one image processor class serves families that differ.
MODEL_ADAPTERS: dict[str, type[MediaAdapter]] = {"qwen3_vl": Qwen3VLAdapter}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_media_adapter(model_dir: Path, tokenizer: Any) -> MediaAdapter | None:
    """The adapter for the model in `model_dir`, or None for a text-only model (no image processor
    config) or one whose processor render has no adapter for (logged: images are then refused)."""
    preprocessor = _read_json(model_dir / "preprocessor_config.json")
    processor_type = str(preprocessor.get("image_processor_type", ""))
    if not processor_type:
        return None
    base_type = processor_type.removesuffix("Fast").removesuffix("Pil")
    adapter_class = ADAPTERS.get(base_type)
    if adapter_class is None:
        log.warning("no media adapter for image processor %s: image inputs will be refused (supported: %s)",
                    processor_type, ", ".join(ADAPTERS))
        return None
    from transformers import AutoImageProcessor

    # The PIL backend, also where torchvision is installed (transformers would then pick its
    # torchvision backend, whose resize gives other pixels): render's tensors stay the same on every
    # install, and its video path (video.py) reuses this processor's PIL steps.
    image_processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
    model_config = _read_json(model_dir / "config.json")
    model_type = model_config.get("model_type")
    if adapter_class is Qwen2VLAdapter:
        adapter_class = MODEL_ADAPTERS.get(model_type, adapter_class)
    adapter = adapter_class(image_processor, tokenizer, model_config, _read_json(model_dir / "processor_config.json"))
    if isinstance(adapter, Qwen2VLAdapter) and adapter.video_marker:
        if model_type in VIDEO_MODEL_TYPES:
            adapter.video = video_math.load_video_settings(model_dir, qwen3=isinstance(adapter, Qwen3VLAdapter))
        else:
            log.warning("video inputs are supported for model_type %s only (this model: %s): videos will be "
                        "refused", " and ".join(VIDEO_MODEL_TYPES), adapter.model_config.get("model_type"))
    log.info("media: %s adapter over %s (image marker %r)", adapter.family, type(image_processor).__name__,
             adapter.image_marker)
    return adapter
