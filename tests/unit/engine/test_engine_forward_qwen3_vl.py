"""The batched paged-KV forward on Qwen3-VL against transformers: interleaved M-RoPE, DeepStack,
images, timestamped videos (one embed run per frame) and mixed batches.

Every sampled step's logits (chunked prefill cut inside an image and inside a video, beside other
rows, then decodes) are compared with HF's step by step (its forward over the prompt, then its own
cached decode of the same tokens), within 1e-5;
greedy batches equal `generate` for images, videos and both; the M-RoPE positions equal HF's
get_rope_index; DeepStack is not a no-op; the encoder output carries the DeepStack levels beside
the merged rows (the layout the encoder cache holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from tito_engine.model.families import Qwen3Family, family_for
from tito_engine.model.forward import BatchedDecoder, MultiModalPrefill
from tito_engine.model.kv_cache import KVLayout, PagedKVCache
from tito_engine.multimodal import vision
from tito_engine.scheduling.plan import RowInput

ATOL = 1e-5
#: Plus 1e-5 of the logit's size: on an AVX-512 machine one logit of 1.015 came out 1.013e-5 from
#: HF's (the kernels sum in another order), just past a bare 1e-5.
RTOL = 1e-5
BLOCK = 4
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1005, 1006, 1003, 1004
PATCH_DIM = 3 * 2 * 16 * 16
#: Token ids standing in for a timestamp's text ("<0.5 seconds>" in the tiny tokenizer).
STAMP = [27, 15, 13, 20, 382, 649, 82, 29]


@pytest.fixture(scope="module")
def model(tiny_qwen3_vl_model):
    return Qwen3VLForConditionalGeneration.from_pretrained(tiny_qwen3_vl_model).eval()


def make_decoder(model, num_blocks=160):
    text = model.config.text_config
    layout = KVLayout(num_layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads, head_dim=text.head_dim,
                      dtype=model.dtype)
    return BatchedDecoder(model, PagedKVCache(layout, num_blocks, BLOCK, torch.device("cpu")), max_positions=512)


@dataclass
class Item:
    """What vision.py reads from a validated item."""

    modality: str
    embed_positions: tuple[int, ...]
    grid_thw: tuple[int, int, int]
    encoder_inputs: dict


@dataclass
class Seq:
    tokens: list[int]
    prompt_len: int
    table: list[int]
    mm: MultiModalPrefill | None = None
    hf_inputs: dict[str, Any] = field(default_factory=dict)
    cached: int = 0
    generated: list[int] = field(default_factory=list)
    hf_state: dict[str, Any] = field(default_factory=dict)  # hf_step_logits' cache


def prompt(seed: int, image: bool = True, video: bool = True):
    """Text, an image (grid 1 x 8 x 12: 24 rows), text, a video (grid 3 x 4 x 4: 3 frames of 4 rows,
    each frame `STAMP <|vision_start|> pads <|vision_end|>` inside the template's outer markers)."""
    g = torch.Generator().manual_seed(seed)
    ids, items, hf = [5, 6, 7 + seed % 5], [], {}
    if image:
        grid = (1, 8, 12)
        pixels = torch.randn(96, PATCH_DIM, generator=g)
        ids += [VISION_START]
        offset = len(ids)
        ids += [IMAGE_PAD] * 24 + [VISION_END, 30, 31]
        items.append(Item("image", tuple(range(offset, offset + 24)), grid, {"pixel_values": pixels}))
        hf.update(pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    if video:
        grid = (3, 4, 4)
        pixels = torch.randn(48, PATCH_DIM, generator=g)
        ids += [40, VISION_START]
        positions = []
        for frame in range(3):
            ids += [*STAMP[:-1], STAMP[-1] + frame, VISION_START]
            positions += range(len(ids), len(ids) + 4)
            ids += [VIDEO_PAD] * 4 + [VISION_END]
        ids += [VISION_END]
        items.append(Item("video", tuple(positions), grid, {"pixel_values_videos": pixels}))
        hf.update(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
    ids += [20, 21, 22]
    hf["mm_token_type_ids"] = vision.mm_token_type_ids(len(ids), items)
    return ids, items, hf


def hf_prompt_positions(model, ids: torch.Tensor, hf: dict) -> torch.Tensor:
    positions, _ = model.model.get_rope_index(ids, hf["mm_token_type_ids"][None], hf.get("image_grid_thw"),
                                              hf.get("video_grid_thw"))
    return positions


@torch.inference_mode()
def hf_step_logits(model, seq: Seq) -> torch.Tensor:
    """HF's logits for the sequence's next token, as HF computes them step by step: the prompt in one
    forward (pixel values, grids, get_rope_index positions), then each generated token through HF's
    own KV cache at one past the prompt's last position, as `generate` does. (HF's full forward over
    prompt + generated tokens differs from its own cached decode by up to ~1e-5 on this model: the
    float32 noise of another summation order.)"""
    from transformers import DynamicCache

    state = seq.hf_state
    if "cache" not in state:
        ids = torch.tensor([seq.tokens[:seq.prompt_len]])
        kwargs = {k: v for k, v in seq.hf_inputs.items() if k != "mm_token_type_ids"}
        if kwargs:
            positions = hf_prompt_positions(model, ids, seq.hf_inputs)
            kwargs["position_ids"] = positions
            state["next"] = int(positions[0, 0, -1]) + 1
        else:
            state["next"] = seq.prompt_len
        state["cache"] = DynamicCache(config=model.config)
        state["logits"] = model(input_ids=ids, past_key_values=state["cache"], use_cache=True, **kwargs).logits[0, -1]
        state["fed"] = seq.prompt_len
    while state["fed"] < len(seq.tokens):
        token = torch.tensor([[seq.tokens[state["fed"]]]])
        position = torch.tensor([state["next"]]).expand(3, 1, 1)
        state["logits"] = model(input_ids=token, position_ids=position, past_key_values=state["cache"],
                                use_cache=True).logits[0, -1]
        state["fed"] += 1
        state["next"] += 1
    return state["logits"].float()


def new_seq(decoder, model, seed=0, image=True, video=True, text_only_length=0) -> Seq:
    if text_only_length:
        ids, mm, hf = [(37 * seed + 11 * j) % 1000 for j in range(text_only_length)], None, {}
    else:
        ids, items, hf = prompt(seed, image, video)
        rows = vision.encode_items(model, items)
        mm = MultiModalPrefill.for_model(model.config, **vision.prefill_media(ids, list(zip(items, rows)),
                                                                                model.config))
    blocks = decoder.cache.allocator.allocate(-(-(len(ids) + 24) // BLOCK))
    return Seq(list(ids), len(ids), blocks, mm, hf)


def step(decoder, model, work: list[tuple[Seq, int]], check: bool = True) -> None:
    rows, sampled = [], []
    for seq, count in work:
        needs = seq.cached + count == len(seq.tokens)
        rows.append(RowInput(seq.tokens[seq.cached:seq.cached + count], seq.cached, seq.table, needs, seq.mm))
        if needs:
            sampled.append(seq)
    logits = decoder.forward(rows)
    for seq, count in work:
        seq.cached += count
    for row_logits, seq in zip(logits, sampled):
        if check:
            torch.testing.assert_close(row_logits, hf_step_logits(model, seq), atol=ATOL, rtol=RTOL)
        token = int(row_logits.argmax())
        seq.tokens.append(token)
        seq.generated.append(token)


def release(decoder, *seqs: Seq) -> None:
    for seq in seqs:
        decoder.cache.allocator.release(seq.table)


# ---------------------------------------------------------------------------- structure


def test_family_and_interleaved_mrope_layout(model):
    family = family_for(model)
    assert isinstance(family, Qwen3Family) and family.mrope_interleaved and family.head_dim == 64
    decoder = make_decoder(model)
    source = decoder.mrope_dim_source[:32].tolist()
    # HF's recomposition: h at 1, 4, ..., w at 2, 5, ... (10 each), t elsewhere.
    assert source[:6] == [0, 1, 2, 0, 1, 2] and source.count(1) == 10 and source.count(2) == 10
    assert decoder.mrope_dim_source[32:].tolist() == source


@pytest.mark.parametrize("image,video", [(True, False), (False, True), (True, True)])
def test_mrope_positions_equal_hf_rope_index(model, image, video):
    ids, items, hf = prompt(1, image, video)
    positions, delta = vision.mrope_positions(ids, items, model.config)
    expected, _ = model.model.get_rope_index(torch.tensor([ids]), hf["mm_token_type_ids"][None],
                                             hf.get("image_grid_thw"), hf.get("video_grid_thw"))
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected[0, 0, -1]) + 1 - len(ids)


def test_encoder_output_carries_deepstack_levels_beside_the_rows(model):
    ids, items, _ = prompt(2)
    rows = vision.encode_items(model, items)
    hidden, levels = model.config.text_config.hidden_size, len(model.config.vision_config.deepstack_visual_indexes)
    assert vision.deepstack_levels(model) == levels == 2
    assert [tuple(r.shape) for r in rows] == [(24, hidden * 3), (12, hidden * 3)]
    with torch.inference_mode():
        out = model.model.get_image_features(items[0].encoder_inputs["pixel_values"],
                                             torch.tensor([items[0].grid_thw]), return_dict=True)
    assert torch.equal(rows[0][:, :hidden], out.pooler_output[0])
    for level in range(levels):
        assert torch.equal(rows[0][:, hidden * (1 + level):hidden * (2 + level)], out.deepstack_features[level][0])
    media = vision.prefill_media(ids, list(zip(items, rows)), model.config)
    assert media["embeds"].shape == (36, hidden) and media["deepstack"].shape == (levels, 36, hidden)


def test_deepstack_changes_the_output(model):
    decoder = make_decoder(model)
    seq = new_seq(decoder, model, seed=3)
    with_levels = decoder.forward([RowInput(seq.tokens, 0, seq.table, True, seq.mm)])
    seq.mm.deepstack = None
    without = decoder.forward([RowInput(seq.tokens, 0, seq.table, True, seq.mm)])
    assert not torch.allclose(with_levels, without, atol=1e-3)
    release(decoder, seq)


# ---------------------------------------------------------------------------- against HF


def test_chunked_prefill_through_image_and_video_beside_text_equals_hf(model):
    decoder = make_decoder(model)
    seq = new_seq(decoder, model, seed=4)
    other = new_seq(decoder, model, seed=5, text_only_length=7)
    video_start = seq.mm.embed_positions[24].item()
    step(decoder, model, [(seq, 12), (other, 7)])  # cut inside the image's rows
    step(decoder, model, [(seq, video_start + 6 - 12), (other, 1)])  # cut inside the video's frames
    step(decoder, model, [(seq, len(seq.tokens) - seq.cached), (other, 1)])
    for _ in range(6):
        step(decoder, model, [(other, 1), (seq, 1)])
    release(decoder, seq, other)


def test_mixed_media_batch_decodes_equal_hf(model):
    decoder = make_decoder(model)
    seqs = [new_seq(decoder, model, seed=6, video=False), new_seq(decoder, model, seed=7, image=False),
            new_seq(decoder, model, seed=8)]
    step(decoder, model, [(seq, len(seq.tokens)) for seq in seqs])
    for _ in range(4):
        step(decoder, model, [(seq, 1) for seq in seqs])
    release(decoder, *seqs)


@pytest.mark.parametrize("image,video", [(True, False), (False, True), (True, True)])
def test_greedy_batch_equals_hf_generate(model, image, video):
    decoder = make_decoder(model)
    seq = new_seq(decoder, model, seed=9, image=image, video=video)
    other = new_seq(decoder, model, seed=10, image=not image, video=True)
    step(decoder, model, [(seq, len(seq.tokens)), (other, len(other.tokens))], check=False)
    for _ in range(11):
        step(decoder, model, [(seq, 1), (other, 1)], check=False)
    for s in (seq, other):
        ids = torch.tensor([s.tokens[:s.prompt_len]])
        inputs = dict(s.hf_inputs, mm_token_type_ids=s.hf_inputs["mm_token_type_ids"][None])
        with torch.inference_mode():
            expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=12, **inputs)[0, s.prompt_len:].tolist()
        assert len(expected) > 3 and s.generated[:len(expected)] == expected
    assert len(set(seq.generated)) > 2  # not stuck on one token
    release(decoder, seq, other)
