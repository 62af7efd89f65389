"""Test support: the placeholder spans of tiny-gemma3's images, written out as Gemma3's processor
writes them, so tests can check render's and the engine's span handling against an independent
reading."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tito_models.tiny import (IMAGE_BEGIN_TOKEN, IMAGE_END_TOKEN, IMAGE_SOFT_TOKEN, INTERLEAVED_SPAN_SEPARATOR,
                              INTERLEAVED_TOKENS_PER_IMAGE, _interleaved_token_ids)


@dataclass(frozen=True)
class ImageSpan:
    """The placeholder span of one image: its tokens and which positions take encoder output."""

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    #: ``True`` where the position is replaced by an encoder output row (the soft tokens).
    is_embed: tuple[bool, ...]

    @property
    def num_embeds(self) -> int:
        return sum(self.is_embed)

    def __len__(self) -> int:
        return len(self.token_ids)


def interleaved_image_span(
    image_inputs: Mapping[str, Any] | None = None,
    image_index: int = 0,
    *,
    tokens_per_image: int = INTERLEAVED_TOKENS_PER_IMAGE,
    token_ids: Mapping[str, int] | None = None,
) -> ImageSpan:
    """The span of image ``image_index`` given the image processor's output for the request.

    The span is ``<start_of_image>``, ``tokens_per_image`` x ``<image_soft_token>``,
    ``<end_of_image>``; ``is_embed`` is true exactly at the soft tokens.  ``token_ids``
    maps those three strings to ids (default: the ``tiny-gemma3`` ids; pass a real
    tokenizer's for a real Gemma3, whose ``tokens_per_image`` is
    ``config.mm_tokens_per_image``).  ``image_inputs`` (``pixel_values`` plus
    ``num_crops``) is only checked: pan-and-scan crops, which would add more spans
    with text between them, are not supported (``ValueError``).
    """
    if tokens_per_image <= 0:
        raise ValueError(f"tokens_per_image must be positive, got {tokens_per_image}")
    if image_inputs is not None:
        num_crops = image_inputs.get("num_crops")
        if num_crops is not None:
            crops = _as_list(num_crops)
            if not 0 <= image_index < len(crops):
                raise ValueError(f"image_index {image_index} out of range for {len(crops)} processed images")
            if int(crops[image_index]) != 0:
                raise ValueError("pan-and-scan crops are not supported: process images with do_pan_and_scan=False")
    ids = dict(_interleaved_token_ids() if token_ids is None else token_ids)
    tokens = (IMAGE_BEGIN_TOKEN,) + (IMAGE_SOFT_TOKEN,) * tokens_per_image + (IMAGE_END_TOKEN,)
    return ImageSpan(
        tokens=tokens,
        token_ids=tuple(ids[token] for token in tokens),
        is_embed=tuple(token == IMAGE_SOFT_TOKEN for token in tokens),
    )


def _as_list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def expand_image_placeholders(text: str, tokens_per_image: int = INTERLEAVED_TOKENS_PER_IMAGE) -> str:
    """Expand every ``<start_of_image>`` in a rendered prompt the way ``Gemma3Processor`` does.

    Each one becomes ``"\\n\\n" + span + "\\n\\n"`` where span is the text of
    :func:`interleaved_image_span`; tokenizing the result gives the processor's ids.
    """
    span = "".join(interleaved_image_span(tokens_per_image=tokens_per_image).tokens)
    return text.replace(IMAGE_BEGIN_TOKEN, INTERLEAVED_SPAN_SEPARATOR + span + INTERLEAVED_SPAN_SEPARATOR)


def find_image_spans(
    token_ids: Sequence[int], token_ids_map: Mapping[str, int] | None = None
) -> list[tuple[int, int]]:
    """``(offset, length)`` of each ``<start_of_image> ... <end_of_image>`` span in ``token_ids``.

    Raises ``ValueError`` for an unterminated span, a nested begin, or a soft token
    outside a span.
    """
    ids = dict(_interleaved_token_ids() if token_ids_map is None else token_ids_map)
    begin, end, soft = ids[IMAGE_BEGIN_TOKEN], ids[IMAGE_END_TOKEN], ids[IMAGE_SOFT_TOKEN]
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for position, token_id in enumerate(token_ids):
        if token_id == begin:
            if start is not None:
                raise ValueError(f"image span opened at {start} is not closed before position {position}")
            start = position
        elif token_id == end:
            if start is None:
                raise ValueError(f"{IMAGE_END_TOKEN} at position {position} closes no span")
            spans.append((start, position - start + 1))
            start = None
        elif token_id == soft and start is None:
            raise ValueError(f"{IMAGE_SOFT_TOKEN} at position {position} is outside an image span")
    if start is not None:
        raise ValueError(f"image span opened at {start} is not closed")
    return spans
