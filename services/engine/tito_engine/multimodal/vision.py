"""Vision building blocks for the runner: encode media, place encoder rows, M-RoPE positions.

Verified against transformers 5.19 (see tests/unit/engine/test_engine_vision.py):

* `encode_images` / `encode_items` call the model's own `get_image_features` /
  `get_video_features` (one call per modality over all items, as HF's forward does: the Qwen2-VL
  vision tower attends within each image through `cu_seqlens`, so batching items does not mix
  them) and split the output into one [rows, hidden] tensor per item.
* `build_prefill_embeddings` embeds the token ids and overwrites exactly the validated embed
  positions with encoder rows (is_embed aware). HF scatters into every position holding the
  placeholder token id instead; admission (`features.py`) guarantees the two sets are equal.
* `mrope_positions` reproduces `Qwen2VLModel.get_rope_index` for one sequence from the validated
  items (their grid and embed run) instead of `mm_token_type_ids`; decode step k (0-based, token
  at index L + k) uses position L + k + rope_delta on all three axes. (One deliberate
  difference: HF finds vision runs by grouping equal `mm_token_type_ids`, so two items with no
  text token between them would merge into one run there; here each item is its own run. Qwen
  prompts always separate items with <|vision_end|><|vision_start|>.)
* `prefill_media` packs the same information sparsely (rows + their positions + M-RoPE
  positions + rope_delta) in the shape the batched runner's `forward.MultiModalPrefill` takes.
* `reference_greedy_decode` is a deliberately plain prefill + decode loop built from the above;
  it equals `model.generate` greedily and is the reference a batched runner can be checked against.

Qwen2.5-VL (`"qwen2_5_vl"`) is Qwen2-VL here except for the time axis of a video's M-RoPE: its
t index is `int(t * tokens_per_second * second_per_grid_ts)` (float32 product, truncated, as
HF's `get_vision_position_ids`) instead of t; its vision tower (windowed attention, RMSNorm,
gated MLP) runs through the model's own `get_image_features` / `get_video_features`.

Qwen3-VL (`"qwen3_vl"`): its vision tower returns, besides the merged rows, one DeepStack row set
per `deepstack_visual_indexes` entry (same rows, text hidden size each), which HF adds to the
hidden states after decoder layers 0..L-1 at the vision positions. Here an item's encoder output
is one tensor `[rows, hidden * (1 + L)]`: the merged rows, then each DeepStack level, side by side
(vLLM's layout too); that is what the encoder cache holds and a descriptor points at, and
`prefill_media` splits it into `embeds` and `deepstack` [L, N, hidden]. A video's M-RoPE treats
each temporal grid step as its own image (t = 1) in its own embed run, the timestamp text between
runs advancing the positions like any text, as HF's get_rope_index does after splitting
video_grid_thw per frame.

Supported families: Qwen2-VL (`model_type == "qwen2_vl"`: images and videos, M-RoPE), Qwen2.5-VL
(`"qwen2_5_vl"`: the same plus the video time axis) and Gemma3
(`"gemma3"`: interleaved spans, fixed rows per image, bidirectional attention inside each image's
run of soft tokens; `embed_token_type_ids` gives the mask input HF's Gemma3 expects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class EmbedItem(Protocol):
    """What these helpers read from a validated item (features.ValidatedItem satisfies it)."""

    modality: str
    embed_positions: tuple[int, ...]
    grid_thw: tuple[int, int, int] | None
    encoder_inputs: Any
    # second_per_grid_ts: float | None, read with getattr (Qwen2.5-VL videos; absent elsewhere)


#: Families whose vision tower takes flattened patches + grid_thw and whose text model uses M-RoPE.
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Families whose encoder output carries DeepStack levels beside the merged rows.
DEEPSTACK_FAMILIES = ("qwen3_vl",)


def model_family(model_or_config: Any) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", "")
    if family not in (*MROPE_FAMILIES, "gemma3"):
        raise ValueError(f"no vision support for model_type {family!r} (supported: qwen2_vl, qwen2_5_vl, qwen3_vl, "
                         f"gemma3)")
    return family


def deepstack_levels(model_or_config: Any) -> int:
    """How many DeepStack row sets an item's encoder output carries beside its merged rows (0: none)."""
    config = getattr(model_or_config, "config", model_or_config)
    if getattr(config, "model_type", "") not in DEEPSTACK_FAMILIES:
        return 0
    return len(config.vision_config.deepstack_visual_indexes)


def _with_deepstack(output: Any) -> list[torch.Tensor]:
    """Per item: the merged rows, then each DeepStack level's rows, side by side."""
    levels = getattr(output, "deepstack_features", None)
    if not levels:
        return list(output.pooler_output)
    return [torch.cat([rows, *(level[k] for level in levels)], dim=-1) for k, rows in enumerate(output.pooler_output)]


def uses_mrope(model_or_config: Any) -> bool:
    return model_family(model_or_config) in MROPE_FAMILIES


# ---------------------------------------------------------------------------- encoding


def _device_dtype(model) -> tuple[torch.device, torch.dtype]:
    weight = model.get_input_embeddings().weight
    return weight.device, weight.dtype


@torch.inference_mode()
def encode_images(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Run the vision tower on a batch of images; one [rows, hidden] tensor per image.

    Qwen2-VL: `pixel_values` is the processor's [sum of patches, C*T*P*P], `grid_thw` [n, 3].
    Gemma3: `pixel_values` is [n, C, S, S] and `grid_thw` is unused.
    """
    device, _ = _device_dtype(model)
    if uses_mrope(model):
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).to(device)
        output = model.get_image_features(pixel_values=pixel_values.to(device), image_grid_thw=grid_thw,
                                          return_dict=True)
        return _with_deepstack(output)
    output = model.get_image_features(pixel_values=pixel_values.to(device, model.dtype), return_dict=True)
    return list(output.pooler_output.unbind(0))


@torch.inference_mode()
def encode_videos(model, pixel_values_videos: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL videos: like `encode_images` through `get_video_features`."""
    device, _ = _device_dtype(model)
    grid_thw = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).to(device)
    output = model.get_video_features(pixel_values_videos=pixel_values_videos.to(device), video_grid_thw=grid_thw,
                                      return_dict=True)
    return _with_deepstack(output)


def encode_items(model, items: Sequence[EmbedItem]) -> list[torch.Tensor]:
    """Encoder rows for each item (in the given order), one encoder call per modality."""
    family = model_family(model)
    rows: list[torch.Tensor | None] = [None] * len(items)
    for modality in dict.fromkeys(item.modality for item in items):
        indices = [k for k, item in enumerate(items) if item.modality == modality]
        group = [items[k] for k in indices]
        if family in MROPE_FAMILIES:
            pixel_key = "pixel_values" if modality == "image" else "pixel_values_videos"
            pixels = torch.cat([item.encoder_inputs[pixel_key] for item in group])
            grids = torch.tensor([item.grid_thw for item in group], dtype=torch.long)
            outputs = (encode_images if modality == "image" else encode_videos)(model, pixels, grids)
        else:
            # [1, C, S, S] or [C, S, S] per item (admission allows both) -> [n, C, S, S]
            images = [item.encoder_inputs["pixel_values"] for item in group]
            pixels = torch.cat([image.reshape(1, *image.shape[-3:]) for image in images])
            outputs = encode_images(model, pixels)
        for k, output in zip(indices, outputs):
            rows[k] = output
    return rows  # type: ignore[return-value]


# ---------------------------------------------------------------------------- prompt inputs


@torch.inference_mode()
def build_prefill_embeddings(model, token_ids: Sequence[int],
                             items_with_rows: Sequence[tuple[EmbedItem, torch.Tensor]]) -> torch.Tensor:
    """inputs_embeds [L, hidden]: token embeddings with each item's rows at its embed positions."""
    device, dtype = _device_dtype(model)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = [torch.tensor(item.embed_positions, dtype=torch.long, device=device) for item, _ in items_with_rows]
    for (item, rows), where in zip(items_with_rows, positions):
        if rows.ndim != 2 or rows.shape[0] != len(where):
            raise ValueError(f"{item.modality} item has {len(where)} embed positions but rows of shape "
                             f"{tuple(rows.shape)}")
        ids[where] = 0  # the placeholder id may lie outside the table (HF does the same); it is overwritten
    embeds = model.get_input_embeddings()(ids)
    for (_, rows), where in zip(items_with_rows, positions):
        embeds[where] = rows.to(device=device, dtype=embeds.dtype)
    return embeds


def mm_token_type_ids(length: int, items: Sequence[EmbedItem]) -> torch.Tensor:
    """HF's `mm_token_type_ids` for one sequence: 1 at image, 2 at video embed positions, else 0."""
    types = torch.zeros(length, dtype=torch.long)
    for item in items:
        types[list(item.embed_positions)] = 1 if item.modality == "image" else 2
    return types


def embed_token_type_ids(length: int, items: Sequence[EmbedItem]) -> torch.Tensor:
    """Gemma3's `token_type_ids`: 1 at every embed position (those attend bidirectionally per image)."""
    types = torch.zeros(length, dtype=torch.long)
    for item in items:
        types[list(item.embed_positions)] = 1
    return types


def _time_positions(item: EmbedItem, t: int, config: Any) -> torch.Tensor:
    """The time axis of an item's grid: 0..t-1, or for a Qwen2.5-VL video
    int(index * tokens_per_second * second_per_grid_ts) computed in float32 as HF does (its
    processor hands second_per_grid_ts over as a float32 tensor; 1.0 when absent)."""
    steps = torch.arange(t)
    if config.model_type != "qwen2_5_vl" or item.modality != "video":
        return steps
    seconds = getattr(item, "second_per_grid_ts", None)
    interval = config.vision_config.tokens_per_second * torch.tensor(1.0 if seconds is None else seconds,
                                                                     dtype=torch.float32)
    return (steps * interval).long()


def _vision_runs(items: Sequence[EmbedItem], config: Any) -> list[tuple[int, EmbedItem, tuple[int, int, int]]]:
    """(first position, item, grid) of each run of embed positions, in prompt order: one per item,
    or for a Qwen3-VL video one per temporal grid step (grid (1, h, w)), timestamps between them."""
    runs = []
    for item in items:
        t, h, w = item.grid_thw
        if config.model_type == "qwen3_vl" and item.modality == "video" and t > 1:
            per_frame = len(item.embed_positions) // t
            runs.extend((item.embed_positions[k * per_frame], item, (1, h, w)) for k in range(t))
        else:
            runs.append((item.embed_positions[0], item, (t, h, w)))
    return sorted(runs, key=lambda run: run[0])


def mrope_positions(token_ids: Sequence[int], items: Sequence[EmbedItem], config: Any) -> tuple[torch.Tensor, int]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL M-RoPE position ids [3, L] and rope_delta for one prompt
    (== HF get_rope_index).

    Text tokens advance all three axes together; an embed run of t*h'*w' tokens (h' = h /
    merge, w' = w / merge) gets (start + time(t_index), start + row, start + column), time being
    the identity except for Qwen2.5-VL videos (`_time_positions`), and the next text resumes at
    start + max(h', w'). A Qwen3-VL video is one such run per frame (t = 1, `_vision_runs`).
    Decode token k (at index L + k) sits at L + k + rope_delta, i.e. right
    after the prompt's last position, as transformers 5.19's `generate` continues its position ids
    (each axis from its last value; a chat prompt ends in text, where the three agree). That is
    not always the prompt's largest position: a Qwen2.5-VL video's time axis, or a Qwen2-VL video
    with more time steps than rows and columns, can reach past the text that follows it.
    """
    config = getattr(config, "config", config)
    merge = config.vision_config.spatial_merge_size
    length = len(token_ids)
    positions = torch.empty(3, length, dtype=torch.long)
    current = 0  # next position value
    cursor = 0  # next token index to place
    for start, item, (t, h, w) in _vision_runs(items, config):
        positions[:, cursor:start] = torch.arange(current, current + start - cursor)
        current += start - cursor
        grid_h, grid_w = h // merge, w // merge
        count = t * grid_h * grid_w
        run = item.embed_positions[item.embed_positions.index(start):][:count]
        if len(run) != count or run[-1] != start + count - 1:
            raise ValueError(f"{item.modality} item's embed positions are not runs of {count} tokens")
        times = _time_positions(item, t, config)
        positions[0, start:start + count] = times.repeat_interleave(grid_h * grid_w) + current
        positions[1, start:start + count] = torch.arange(grid_h).repeat_interleave(grid_w).repeat(t) + current
        positions[2, start:start + count] = torch.arange(grid_w).repeat(t * grid_h) + current
        current += max(grid_h, grid_w)
        cursor = start + count
    positions[:, cursor:] = torch.arange(current, current + length - cursor)
    rope_delta = int(positions[:, -1].max()) + 1 - length if length else 0
    return positions, rope_delta


def mrope_decode_positions(start_index: int, count: int, rope_delta: int) -> torch.Tensor:
    """Position ids [3, count] for the tokens at indices start_index .. start_index + count - 1."""
    return (torch.arange(start_index, start_index + count) + rope_delta).expand(3, count)


def prefill_media(token_ids: Sequence[int], items_with_rows: Sequence[tuple[EmbedItem, torch.Tensor]],
                  config: Any) -> dict[str, Any]:
    """The sparse form of a multimodal prefill, keyed like `forward.MultiModalPrefill`'s fields.

    `embeds` [N, hidden] (every item's rows, in prompt order), `embed_positions` [N] (ascending
    absolute prompt indices), `deepstack` [L, N, hidden] (Qwen3-VL: the DeepStack levels of the
    same rows, split off the encoder output; else None), and for M-RoPE models `mrope_positions` [3, L] and `rope_delta`
    (else None and 0). `MultiModalPrefill(**prefill_media(...))` builds the runner's object.
    """
    ordered = sorted(items_with_rows, key=lambda pair: pair[0].embed_positions[0])
    for item, rows in ordered:
        if rows.ndim != 2 or rows.shape[0] != len(item.embed_positions):
            raise ValueError(f"{item.modality} item has {len(item.embed_positions)} embed positions but rows of "
                             f"shape {tuple(rows.shape)}")
    embeds = torch.cat([rows for _, rows in ordered]) if ordered else None
    deepstack = None
    levels = deepstack_levels(config)
    if levels and embeds is not None:
        # [N, hidden * (1 + L)] -> the merged rows [N, hidden] and the levels [L, N, hidden].
        hidden = embeds.shape[1] // (1 + levels)
        deepstack = embeds[:, hidden:].reshape(embeds.shape[0], levels, hidden).transpose(0, 1).contiguous()
        embeds = embeds[:, :hidden]
    result: dict[str, Any] = {
        "embeds": embeds,
        "deepstack": deepstack,
        "embed_positions": torch.tensor([p for item, _ in ordered for p in item.embed_positions], dtype=torch.long)
        if ordered else None,
        "mrope_positions": None,
        "rope_delta": 0,
    }
    if uses_mrope(config):
        result["mrope_positions"], result["rope_delta"] = mrope_positions(token_ids, [i for i, _ in ordered], config)
    return result


def prefill_positions(token_ids: Sequence[int], items: Sequence[EmbedItem], config: Any) -> dict[str, Any]:
    """`prefill_media` without encoder rows: where the items sit and the M-RoPE positions, for a
    prompt whose KV was computed elsewhere (prefill/decode: the decode engine computes no
    position that takes encoder rows, so it never runs the encoder)."""
    ordered = sorted(items, key=lambda item: item.embed_positions[0])
    result: dict[str, Any] = {
        "embeds": None, "deepstack": None, "mrope_positions": None, "rope_delta": 0,
        "embed_positions": torch.tensor([p for item in ordered for p in item.embed_positions], dtype=torch.long)
        if ordered else None,
    }
    if uses_mrope(config):
        result["mrope_positions"], result["rope_delta"] = mrope_positions(token_ids, list(ordered), config)
    return result


# ---------------------------------------------------------------------------- reference loop


@torch.inference_mode()
def reference_greedy_decode(model, token_ids: Sequence[int],
                            items_with_rows: Sequence[tuple[EmbedItem, torch.Tensor]],
                            max_new_tokens: int, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy generation for one request, one token per forward: a correctness reference, not a server.

    Prefill: `build_prefill_embeddings` + (Qwen2-VL, Qwen2.5-VL) `mrope_positions`, or (Gemma3)
    `embed_token_type_ids`; decode: plain token ids with `mrope_decode_positions`.
    """
    from transformers import DynamicCache

    device, _ = _device_dtype(model)
    family = model_family(model)
    items = [item for item, _ in items_with_rows]
    embeds = build_prefill_embeddings(model, token_ids, items_with_rows)[None]
    # HF's forward takes the KV cache as `past_key_values` (transformers 5.19). A `cache=` keyword is not a
    # forward argument there: it falls through **kwargs to the attention function, which reads `cache` only as a
    # continuous-batching PagedAttentionCache and otherwise ignores it, so every decode step ran without context.
    cache = DynamicCache(config=model.config)
    length = len(token_ids)
    rope_delta = 0
    if family in MROPE_FAMILIES:
        positions, rope_delta = mrope_positions(token_ids, items, model.config)
        output = model(inputs_embeds=embeds, position_ids=positions[:, None, :].to(device), past_key_values=cache,
                       use_cache=True)
    else:
        output = model(inputs_embeds=embeds, token_type_ids=embed_token_type_ids(length, items)[None].to(device),
                       past_key_values=cache, use_cache=True)
    generated: list[int] = []
    for step in range(max_new_tokens):
        token = int(output.logits[0, -1].argmax())
        generated.append(token)
        if token in eos_token_ids or step == max_new_tokens - 1:
            break
        input_ids = torch.tensor([[token]], device=device)
        if family in MROPE_FAMILIES:
            position_ids = mrope_decode_positions(length + step, 1, rope_delta)[:, None, :].to(device)
            output = model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        else:
            output = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    return generated
