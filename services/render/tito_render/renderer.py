"""Render requests into what the engine and derender need (blocking; call from a worker thread).

request -> validate -> chat template / tokenize -> resolve sampling -> a `domain.RenderedPrompt`.
Works on `domain` values only: convert.py makes them from the request message and makes the
response (GenerateRequest + DerenderContext) from the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

from tito import tracing
from tito.config import DEFAULT_MAX_MESSAGE_BYTES
from tito.errors import FieldViolation, InvalidArgument
from tito.lora_names import check_lora_name
from tito.structured_output import StructuredOutputSpec

from tito_render.chat_template import (DEFAULT_TEMPLATE_SECONDS, ChatRenderOptions, ends_inside_reasoning,
                                       render_chat_text)
from tito_render.domain import (ChatRequest, CompletionRequest, MediaOptions, MmPayload, Modality, RenderedPrompt,
                                SamplingOptions, SamplingParams, TextPart, TokenizeRequest, Tokens, ToolChoice)
from tito_render.media.cache import CachedImage, ProcessedImageCache
from tito_render.media.features import TENSORS, Signer, build_item, resolve_payload
from tito_render.media import video as video_math
from tito_render.media.hashing import VideoHasher, image_hash, rgb_pixels
from tito_render.long_text import LongTextEncoder
from tito_render.media.loader import MediaPolicy, PixelBudget, decode_image, read_source
from tito_render.media.placeholders import check_marker_count, expand_media_markers, locate_spans
from tito_render.media.processors import MediaAdapter, ProcessedImage
from tito_render.media.video import VideoSettings
from tito_render.messages import (ImageRef, VideoRef, collect_media, messages_to_dicts, resolve_tool_choice,
                                  request_struct, tools_to_dicts)
from tito_render.model import THINK_END, THINK_START, RenderModel
from tito_render.sampling import SamplingLimits, keeps_special_tokens_for_tools, resolve_sampling
from tito_render.structured import explicit_structured_output, reasoning_start, resolve_structured_output

log = logging.getLogger(__name__)

_MM_PAYLOAD_VALUES = frozenset(MmPayload)


def new_request_id(given: str) -> str:
    return given or uuid.uuid4().hex


@dataclass(frozen=True)
class RenderLimits:
    """Per-request limits (each error names its limit and flag)."""

    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_images_per_request: int = 32
    #: Most frames in one video (each frame also counts toward max_images_per_request).
    max_video_frames: int = 64
    #: 0 = the context limit only.
    max_prompt_tokens: int = 0
    #: Largest response render may send (the server's max_message_bytes).
    max_response_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Bytes of processed images kept for reuse (0 = no cache).
    media_cache_bytes: int = 0
    #: Seconds a chat template may run on one chat.
    max_template_seconds: float = DEFAULT_TEMPLATE_SECONDS

    @classmethod
    def from_config(cls, config) -> "RenderLimits":
        return cls(media=MediaPolicy.from_config(config), max_images_per_request=config.max_images_per_request,
                   max_video_frames=config.max_video_frames,
                   max_prompt_tokens=config.max_prompt_tokens, max_response_bytes=config.max_message_bytes,
                   media_cache_bytes=config.media_cache_mb * 1024 * 1024,
                   max_template_seconds=config.max_template_seconds)


@dataclass
class PromptMedia:
    """The images (or videos) of one chat, processed, with their hashes (in prompt order)."""

    refs: list
    processed: list[ProcessedImage]
    hashes: list[str]


@dataclass
class CheckedChat:
    """A chat request that passed every check that needs no work: its messages and tools as the
    template takes them, the resolved tool choice and template options, its media references."""

    messages: list[dict]
    tools: list[dict] | None  # None when the request has none, as HF templates expect
    tool_choice: ToolChoice
    options: ChatRenderOptions
    images: list[ImageRef]
    videos: list[VideoRef]
    payload: int  # an MmPayload: what each media item carries to the engine


@dataclass
class PromptText:
    """The prompt after its media markers were expanded, with its media items in prompt order."""

    text: str
    processed: list[ProcessedImage]
    hashes: list[str]


class Renderer:
    """Stateless request rendering over one loaded model."""

    def __init__(self, model: RenderModel, limits: RenderLimits | None = None, signer: Signer | None = None) -> None:
        self.model = model
        self.limits = limits or RenderLimits()
        self.signer = signer
        self.image_cache = ProcessedImageCache(self.limits.media_cache_bytes)
        self.encoder = LongTextEncoder(model.tokenizer, model.path)  # long text: off this process's GIL
        #: Called with (modality, items, seconds) after a request's images or videos are processed
        #: (the server's metrics; None: nobody is counting).
        self.on_media_processed: Callable[[str, int, float], None] | None = None

    # ------------------------------------------------------------------ chat
    def chat_options(self, request: ChatRequest, time_remaining: float | None = None) -> ChatRenderOptions:
        """`time_remaining`: seconds left before the call's deadline (None: no deadline)."""
        kwargs = (request_struct(request.chat_template_kwargs, "chat_template_kwargs")
                  if request.chat_template_kwargs is not None else {})
        if request.continue_final_message:
            if request.add_generation_prompt:
                raise InvalidArgument("continue_final_message needs add_generation_prompt false (or unset)",
                                      reason="CONFLICTING_OPTIONS", field="continue_final_message")
            add_generation_prompt = False  # the default "true" yields to an explicit continuation
        else:
            add_generation_prompt = request.add_generation_prompt if request.add_generation_prompt is not None else True
        return ChatRenderOptions(
            chat_template=request.chat_template,
            template_kwargs=kwargs, add_generation_prompt=add_generation_prompt,
            continue_final_message=request.continue_final_message,
            time_limit=min(self.limits.max_template_seconds, max(time_remaining, 0.0))
            if time_remaining is not None else self.limits.max_template_seconds)

    def render_chat(self, request: ChatRequest, request_id: str = "",
                    time_remaining: float | None = None) -> RenderedPrompt:
        """`request_id` (when given) overrides the request's own (the servicer assigns one up front);
        `time_remaining` is what is left of the call's deadline (the template stops by then).

        Five stages, each its own method: check the chat (`_check_chat`), run the template
        (`_template`), process its media and expand their markers (`_expand_media`), tokenize
        (`_tokenize`), and gather what the response holds (`_chat_prompt`: media items, sampling,
        derender's context). The caller checks the response's size once it is built
        (convert.chat_response_to_proto)."""
        chat = self._check_chat(request, time_remaining)
        text = self._template(chat)
        prompt = self._expand_media(chat, text, request.media_options)
        token_ids = self._tokenize(prompt.text)
        rendered = self._chat_prompt(request, request_id, chat, text, token_ids, prompt)
        rendered.usage_in_every_chunk = request.usage_in_every_chunk
        if log.isEnabledFor(logging.INFO):
            log.info("rendered chat: %d messages, %d tools, %d images, %d videos (%s), %d prompt tokens, max_tokens %d",
                     len(chat.messages), len(request.tools), len(chat.images), len(chat.videos),
                     f"MM_PAYLOAD_{MmPayload(chat.payload).name}", len(token_ids), rendered.sampling.max_tokens)
        return rendered

    def _check_chat(self, request: ChatRequest, time_remaining: float | None) -> CheckedChat:
        """Stage 1: everything about the request that can be refused before any work is done."""
        refs = collect_media(request.messages, self.limits.max_images_per_request,
                             self.limits.max_video_frames)
        images = [ref for ref in refs if isinstance(ref, ImageRef)]
        videos = [ref for ref in refs if isinstance(ref, VideoRef)]
        media = self.model.media
        if refs and media is None:
            raise InvalidArgument(f"model {self.model.model_id} takes no image or video input",
                                  reason="UNSUPPORTED_MODALITY", field=refs[0].field)
        if videos and media.video is None:
            raise InvalidArgument(f"model {self.model.model_id} ({media.family}) takes no video input; send "
                                  f"frames as image parts", reason="UNSUPPORTED_MODALITY", field=videos[0].field)
        if request.mm_payload not in _MM_PAYLOAD_VALUES:
            raise InvalidArgument(f"unknown mm_payload {request.mm_payload}", reason="INVALID_MM_PAYLOAD",
                                  field="mm_payload")
        for index, message in enumerate(request.messages):  # templates render every message's content
            self.check_text_length(len(message.content or ""), f"messages[{index}].content")
            for part_index, part in enumerate(message.content_parts):
                if isinstance(part, TextPart):
                    self.check_text_length(len(part.text), f"messages[{index}].content_parts[{part_index}].text")
        messages = messages_to_dicts(request.messages)
        if request.continue_final_message and "content" not in messages[-1]:
            raise InvalidArgument("continue_final_message needs a final message with content to continue",
                                  reason="CONFLICTING_OPTIONS", field="continue_final_message")
        return CheckedChat(messages=messages, tools=tools_to_dicts(request.tools),
                           tool_choice=resolve_tool_choice(request.tool_choice, request.tools),
                           options=self.chat_options(request, time_remaining), images=images, videos=videos,
                           payload=resolve_payload(request.mm_payload))

    def _template(self, chat: CheckedChat) -> str:
        """Stage 2: the chat template's text (bounded in time by the options)."""
        with tracing.span("render.template", messages=len(chat.messages), tools=len(chat.tools or ())):
            text = render_chat_text(self.model.tokenizer, chat.messages, chat.tools, chat.options)
        self.check_text_length(len(text), "messages")
        return text

    def _expand_media(self, chat: CheckedChat, text: str, media_options: MediaOptions) -> PromptText:
        """Stage 3: process the chat's images and videos and replace each marker the template left
        with the item's placeholder tokens (as text); the items in prompt order."""
        media = self.model.media
        if media is None:
            return PromptText(text, [], [])
        template_field = "chat_template" if chat.options.chat_template is not None else "messages"
        check_marker_count(text, media.image_marker, len(chat.images), template_field)
        if media.video_marker:
            check_marker_count(text, media.video_marker, len(chat.videos), template_field, kind="video")
        if not (chat.images or chat.videos):
            return PromptText(text, [], [])
        budget = PixelBudget(self.limits.media.max_request_pixels)
        with tracing.span("render.media", images=len(chat.images), videos=len(chat.videos)):
            image_media = self._process_images(media, chat.images, media_options, chat.payload, budget)
            video_media = self._process_videos(media, chat.videos, media_options, chat.payload, budget)
        by_marker = {media.image_marker: image_media, media.video_marker: video_media}
        prompt, order = expand_media_markers(
            text, {marker: found.processed for marker, found in by_marker.items() if marker})
        return PromptText(prompt, [by_marker[marker].processed[i] for marker, i in order],
                          [by_marker[marker].hashes[i] for marker, i in order])

    def _tokenize(self, prompt: str) -> list[int]:
        """Stage 4: the prompt's ids (long prompts off this process's GIL)."""
        with tracing.span("render.tokenize", characters=len(prompt)):
            token_ids = self.encoder.encode(prompt, add_special_tokens=False)
        tracing.add_attributes(prompt_tokens=len(token_ids))
        if not token_ids:
            raise InvalidArgument("the chat template rendered an empty prompt", reason="EMPTY_PROMPT",
                                  field="messages")
        return token_ids

    def _chat_prompt(self, request: ChatRequest, request_id: str, chat: CheckedChat, text: str,
                     token_ids: list[int], prompt: PromptText) -> RenderedPrompt:
        """Stage 5: the engine's request (ids, media items, sampling, structured output) and
        derender's context, as values."""
        media = self.model.media
        items = []
        if media is not None:
            offsets = locate_spans(token_ids, prompt.processed, media.reserved_token_ids)
            items = [build_item(p, h, offset, chat.payload, self.signer)
                     for p, h, offset in zip(prompt.processed, prompt.hashes, offsets)]
        self.check_prompt_tokens(len(token_ids), "messages")
        thinking = _thinking_enabled(chat.options, self.model)
        reasoning = reasoning_start(self.model.reasoning_parser, thinking, text)
        constraint = resolve_structured_output(request, chat.tools, chat.tool_choice,
                                               self.model.tool_markup or self.model.tool_parser, reasoning)
        rendered = self._finish(request_id or request.request_id, token_ids, request.sampling, request.cache_salt,
                                "messages", constraint)
        rendered.lora_name = _lora_name(request.lora_name)
        rendered.items = items
        rendered.tool_choice = chat.tool_choice
        if keeps_special_tokens_for_tools(self.model.tool_parser, bool(request.tools), chat.tool_choice,
                                          request.sampling):
            rendered.sampling = _keeping_special_tokens(rendered.sampling)
        rendered.thinking_enabled = thinking
        rendered.prompt_opens_reasoning = bool(self.model.reasoning_parser) and ends_inside_reasoning(
            text, THINK_START, THINK_END)
        if request.return_prompt_text:
            rendered.prompt_text = text
        return rendered

    def _process_images(self, media: MediaAdapter, refs: list[ImageRef], media_options: MediaOptions,
                        payload: int, budget: PixelBudget) -> PromptMedia:
        """Validate media_options, then load, hash and process each image (fail fast, field-named)."""
        started = time.perf_counter()
        kwargs = media.call_kwargs(media_options, self.limits.media.max_image_pixels)
        hash_options = media.effective_options(kwargs)
        processed, hashes = [], []
        with_tensors = payload == TENSORS
        cache = self.image_cache
        for ref in refs:
            encoded, encoded_field = read_source(ref.source, ref.field, self.limits.media)
            # The key is a SHA-256 of the encoded bytes (milliseconds for a large image): only
            # computed when there is a cache to look in.
            key = cache.key(encoded, media.family, hash_options) if cache.enabled else None
            cached = cache.get(key, need_tensors=with_tensors) if key is not None else None
            if cached is None:
                image = decode_image(encoded, encoded_field, self.limits.media, budget)
                pixels = rgb_pixels(image)  # packed once, for the hash and the processor
                # With tensors, the hash runs on a helper thread while the processor works
                # (hashlib and Pillow's resize release the GIL): the latency of the two is
                # about that of the processor alone.
                hashing = (_hash_pool().submit(image_hash, image, media.family, hash_options, pixels)
                           if with_tensors else None)
                try:
                    result = media.process(image, kwargs, with_tensors=with_tensors, pixels=pixels)
                except (ValueError, TypeError) as exc:
                    raise InvalidArgument(f"the image processor rejected this image: {exc}",
                                          reason="IMAGE_PROCESSING_FAILED", field=ref.field) from exc
                finally:
                    if hashing is not None:
                        hashing.exception()  # wait even when processing failed: no hash left running
                mm_hash = (hashing.result() if hashing is not None
                           else image_hash(image, media.family, hash_options, pixels))
                cached = CachedImage(mm_hash, result)
                if key is not None:
                    cache.put(key, cached)
            hashes.append(cached.mm_hash)
            processed.append(cached.processed)
        self._media_done("image", len(refs), started)
        return PromptMedia(refs, processed, hashes)

    def _process_videos(self, media: MediaAdapter, refs: list[VideoRef], media_options: MediaOptions,
                        payload: int, budget: PixelBudget) -> PromptMedia:
        """Load every frame (the image loader and limits), then hash and process each video."""
        if not refs:
            return PromptMedia([], [], [])
        started = time.perf_counter()
        media.call_kwargs(media_options, self.limits.media.max_image_pixels)  # validates media_options
        settings = media.video_settings(media_options)
        hash_options = settings.hash_options()
        processed, hashes = [], []
        with_tensors = payload == TENSORS
        for ref in refs:
            encoded = [read_source(frame, ref.frame_field(k), self.limits.media) for k, frame in enumerate(ref.frames)]
            key = (self.image_cache.key(_frames_key(encoded), media.family, {"video": hash_options, "fps": ref.fps})
                   if self.image_cache.enabled else None)
            cached = self.image_cache.get(key, need_tensors=with_tensors) if key is not None else None
            if cached is None:
                cached = CachedImage(*self._decode_video(media, ref, encoded, settings, hash_options, with_tensors,
                                                        budget))
                if key is not None:
                    self.image_cache.put(key, cached)
            hashes.append(cached.mm_hash)
            processed.append(cached.processed)
        self._media_done("video", len(refs), started)
        return PromptMedia(refs, processed, hashes)

    def _media_done(self, modality: str, count: int, started: float) -> None:
        if not count:
            return
        seconds = time.perf_counter() - started
        log.debug("processed %d %ss in %.1f ms", count, modality, seconds * 1e3)
        if self.on_media_processed is not None:
            self.on_media_processed(modality, count, seconds)

    def _decode_video(self, media: MediaAdapter, ref: VideoRef, encoded: list[tuple[bytes, str]],
                      settings: VideoSettings, hash_options: dict, with_tensors: bool,
                      budget: PixelBudget) -> tuple[str, ProcessedImage]:
        """Decode, hash and (with tensors) resize one frame at a time, so that at most one full-size
        frame is held; then the video's tensors from the resized frames."""
        hasher: VideoHasher | None = None
        resized: list | None = [] if with_tensors else None
        for k, (data, data_field) in enumerate(encoded):
            frame = decode_image(data, data_field, self.limits.media, budget)
            if hasher is None:
                try:
                    video_math.resized_size(frame.height, frame.width, len(encoded), settings)
                except ValueError as exc:
                    raise InvalidArgument(f"the video processor rejected this video: {exc}",
                                          reason="VIDEO_PROCESSING_FAILED", field=ref.field) from exc
                hasher = VideoHasher(len(encoded), frame.size, ref.fps, media.family, hash_options)
            elif frame.size != hasher.size:
                raise InvalidArgument(
                    f"frame {k} is {frame.width}x{frame.height} but frame 0 is {hasher.size[0]}x{hasher.size[1]}: "
                    f"all frames of a video must have one size", reason="VIDEO_FRAME_SIZE_MISMATCH",
                    field=ref.frame_field(k))
            hasher.update(frame)
            if resized is not None:
                resized.append(video_math.resize_frame(frame, len(encoded), settings))
        assert hasher is not None  # a video has at least one frame (messages_to_dicts checks)
        return hasher.hexdigest(), media.process_video(len(encoded), hasher.size, resized, settings, ref.fps)

    @property
    def max_text_chars(self) -> int:
        """The longest text that could tokenize within the prompt limit. A token covers at most the
        model's longest vocabulary entry; a normalizer may merge a few characters into one (NFC),
        hence the factor 4. Longer text is refused before it is templated or tokenized, which for
        megabytes of text would hold a render thread (and the GIL) for seconds."""
        tokens = self.limits.max_prompt_tokens or self.model.max_context_length
        return tokens * self.model.longest_token_chars * 4

    def check_text_length(self, length: int, field: str) -> None:
        limit = self.max_text_chars
        if length > limit:
            tokens = self.limits.max_prompt_tokens or self.model.max_context_length
            raise InvalidArgument(f"{field} has {length} characters: more than could ever fit the prompt limit of "
                                  f"{tokens} tokens (at most {limit} characters), refused before tokenizing",
                                  reason="PROMPT_TOO_LONG", field=field,
                                  metadata={"limit": "max_prompt_tokens", "max": str(tokens)})

    def check_prompt_tokens(self, count: int, field: str) -> None:
        limit = self.limits.max_prompt_tokens
        if limit and count > limit:
            raise InvalidArgument(f"prompt is {count} tokens, over the limit max_prompt_tokens={limit} "
                                  f"(--max-prompt-tokens)", reason="PROMPT_TOO_LONG", field=field,
                                  metadata={"limit": "max_prompt_tokens", "max": str(limit)})

    # ------------------------------------------------------------ completion
    def render_completion(self, request: CompletionRequest, request_id: str = "") -> RenderedPrompt:
        has_text, has_ids = request.prompt is not None, len(request.prompt_token_ids) > 0
        if has_text == has_ids:
            raise InvalidArgument("set exactly one of prompt and prompt_token_ids", reason="INVALID_PROMPT",
                                  field="prompt",
                                  violations=[FieldViolation("prompt_token_ids",
                                                             "set exactly one of prompt and prompt_token_ids")])
        if has_text:
            self.check_text_length(len(request.prompt), "prompt")
            add_special = request.add_special_tokens if request.add_special_tokens is not None else True
            with tracing.span("render.tokenize", characters=len(request.prompt)):
                token_ids = self.encoder.encode(request.prompt, add_special_tokens=add_special)
            field = "prompt"
            if not token_ids:
                raise InvalidArgument("prompt encodes to no tokens", reason="EMPTY_PROMPT", field="prompt")
        else:
            token_ids = list(request.prompt_token_ids)
            self.check_token_ids(token_ids, "prompt_token_ids")
            field = "prompt_token_ids"
        self.check_prompt_tokens(len(token_ids), field)
        if self.model.media is not None:
            # A raw prompt carries no media items: placeholder tokens in it would point the engine
            # at encoder output that does not exist.
            locate_spans(token_ids, [], self.model.media.reserved_token_ids, field)
        rendered = self._finish(request_id or request.request_id, token_ids, request.sampling, request.cache_salt,
                                field, explicit_structured_output(request.sampling))
        rendered.usage_in_every_chunk = request.usage_in_every_chunk
        rendered.lora_name = _lora_name(request.lora_name)
        return rendered

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        vocab = self.model.vocab_size
        for i, token_id in enumerate(token_ids):
            if token_id >= vocab:
                raise InvalidArgument(f"token id {token_id} is outside the vocabulary [0, {vocab})",
                                      reason="TOKEN_ID_OUT_OF_RANGE", field=f"{field}[{i}]")

    # ------------------------------------------------------------ shared tail
    def _finish(self, request_id: str, token_ids: list[int], sampling: SamplingOptions,
                cache_salt: str, prompt_field: str,
                structured_output: StructuredOutputSpec | None = None) -> RenderedPrompt:
        """What a chat and a completion share: the id, the resolved sampling and the parsers.
        `structured_output`: the checked constraint (structured.py), if any."""
        params = resolve_sampling(sampling, SamplingLimits(
            prompt_tokens=len(token_ids), max_context_length=self.model.max_context_length,
            vocab_size=self.model.vocab_size, generation_defaults=self.model.generation_defaults,
            prompt_field=prompt_field))
        if self.model.keep_special_tokens and sampling.skip_special_tokens is None:
            params = _keeping_special_tokens(params)  # the parsers' markers are special tokens
        if structured_output is not None:
            params = dataclasses.replace(params, structured_output=structured_output)
        return RenderedPrompt(request_id=new_request_id(request_id), token_ids=token_ids, sampling=params,
                              cache_salt=cache_salt, reasoning_parser=self.model.reasoning_parser,
                              tool_parser=self.model.tool_parser)

    # ------------------------------------------------------------- tokenize
    def tokenize(self, request: TokenizeRequest) -> Tokens:
        self.check_text_length(len(request.text), "text")
        token_ids = self.encoder.encode(request.text, request.add_special_tokens)
        strings = self.model.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strings else None
        return Tokens(token_ids, strings)

    def modalities(self) -> list[int]:
        """The modalities the model takes."""
        media = self.model.media
        if media is None:
            return []
        return [Modality.IMAGE] + ([Modality.VIDEO] if media.video is not None else [])


_HASH_POOL: ThreadPoolExecutor | None = None
_HASH_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """Threads that hash images while the image processor runs (shared by a process's renderers;
    as many as the render threads that may wait on them, see server.RENDER_THREADS)."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            _HASH_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="render-hash")
        return _HASH_POOL


def _frames_key(encoded: list[tuple[bytes, str]]) -> bytes:
    """A digest of the frames' encoded bytes, length-prefixed, as one cache-key input (order matters)."""
    digest = hashlib.sha256(b"tito.render.video-frames.v1\x00")
    for data, _ in encoded:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()



def _lora_name(name: str) -> str:
    """The adapter a request names, checked against the rule every service shares (an empty name:
    the base model). Whether an engine holds it is the engine's to say."""
    if name:
        check_lora_name(name)
    return name


def _keeping_special_tokens(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, text_options=dataclasses.replace(params.text_options,
                                                                        skip_special_tokens=False))


def _thinking_enabled(options: ChatRenderOptions, model: RenderModel) -> bool:
    """The template's enable_thinking switch when the request sets it, else: the model reasons."""
    enable_thinking = (options.template_kwargs or {}).get("enable_thinking")
    return enable_thinking if isinstance(enable_thinking, bool) else bool(model.reasoning_parser)
