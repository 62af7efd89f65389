"""The batched paged-KV forward on Llama (and Mistral), Qwen3 and Qwen2.5-VL, against transformers.

Every step's logits are compared with HF's full forward over the sequence so far (prefill in
chunks beside other rows, then decodes); greedy runs of several prompts of different lengths in
one batch equal `generate` for each prompt alone. Variants built from the tiny models' weights
cover tied embeddings (Llama 3.2-style) and Mistral with and without a sliding window. Qwen2.5-VL
images and videos go through the engine's encoder path (vision.encode_items + prefill_media)
against HF's forward / generate with pixel values, grids and second_per_grid_ts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2_5_VLForConditionalGeneration)

from tito_engine.multimodal import vision
from tito_engine.model.families import FULL, SLIDING, Qwen3Family, QwenFamily, family_for
from tito_engine.model.forward import BatchedDecoder, MultiModalPrefill
from tito_engine.scheduling.plan import RowInput
from tito_engine.model.kv_cache import KVLayout, PagedKVCache

ATOL = 1e-5
BLOCK = 4
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1005, 1006, 1003, 1004


# ---------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def llama(tiny_llama_model):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_model).eval()


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_model):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_model).eval()


@pytest.fixture(scope="module")
def qwen2_5_vl(tiny_qwen2_5_vl_model):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen2_5_vl_model).eval()


@pytest.fixture(scope="module")
def llama_tied(tiny_llama_model):
    """The tiny Llama with its head tied to the embedding (as Llama 3.2 1B / 3B ship)."""
    untied = LlamaForCausalLM.from_pretrained(tiny_llama_model)
    config = LlamaForCausalLM.config_class.from_pretrained(tiny_llama_model)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _mistral(llama, sliding_window):
    """A Mistral with the tiny Llama's weights (the same layers), default rotary, given window."""
    settings = {k: v for k, v in llama.config.to_dict().items() if k in MistralConfig().to_dict()}
    settings.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=sliding_window,
                    model_type="mistral")
    model = MistralForCausalLM(MistralConfig(**settings)).eval()
    model.load_state_dict(llama.state_dict())
    return model


@pytest.fixture(scope="module")
def mistral(llama):
    return _mistral(llama, None)


@pytest.fixture(scope="module")
def mistral_window8(llama):
    return _mistral(llama, 8)


def make_decoder(model, num_blocks=128):
    text = model.config.get_text_config()
    layout = KVLayout(num_layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads,
                      head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                      dtype=model.dtype)
    return BatchedDecoder(model, PagedKVCache(layout, num_blocks, BLOCK, torch.device("cpu")), max_positions=512)


# ---------------------------------------------------------------------------- a tiny driver


@dataclass
class Seq:
    tokens: list[int]
    prompt_len: int
    table: list[int]
    mm: MultiModalPrefill | None = None
    hf_inputs: dict[str, Any] = field(default_factory=dict)  # multimodal kwargs for HF's forward
    cached: int = 0
    generated: list[int] = field(default_factory=list)


def hf_logits(model, seq: Seq) -> torch.Tensor:
    """HF's logits at every position of seq.tokens (full forward, no cache). With media, the
    positions are the ones HF's `generate` uses: get_rope_index over the prompt, then each
    generated token one past the prompt's last position (get_rope_index's rope_delta, from the
    largest position, differs where a video's time axis reaches past the text after it)."""
    ids = torch.tensor([seq.tokens])
    kwargs = dict(seq.hf_inputs)
    if kwargs:
        types = kwargs.pop("mm_token_type_ids")
        prompt, _ = model.model.get_rope_index(
            ids[:, :seq.prompt_len], types[None], kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"),
            second_per_grid_ts=kwargs.pop("second_per_grid_ts", None))
        generated = torch.arange(1, len(seq.tokens) - seq.prompt_len + 1) + int(prompt[0, 0, -1])
        kwargs["position_ids"] = torch.cat([prompt, generated.expand(3, 1, -1)], dim=2)
    with torch.inference_mode():
        return model(input_ids=ids, **kwargs).logits[0].float()


def step(decoder, model, work: list[tuple[Seq, int]], check: bool = True) -> None:
    rows, sampled = [], []
    for seq, count in work:
        needs = seq.cached + count == len(seq.tokens)
        rows.append(RowInput(seq.tokens[seq.cached:seq.cached + count], seq.cached, seq.table, needs, seq.mm))
        if needs:
            sampled.append(seq)
    logits = decoder.forward(rows)
    assert logits.shape[0] == len(sampled)
    for seq, count in work:
        seq.cached += count
    for row_logits, seq in zip(logits, sampled):
        if check:
            torch.testing.assert_close(row_logits, hf_logits(model, seq)[-1], atol=ATOL, rtol=0)
        token = int(row_logits.argmax())
        seq.tokens.append(token)
        seq.generated.append(token)


def new_seq(decoder, prompt, mm=None, hf_inputs=None) -> Seq:
    blocks = decoder.cache.allocator.allocate(-(-(len(prompt) + 24) // BLOCK))
    return Seq(list(prompt), len(prompt), blocks, mm, hf_inputs or {})


def release(decoder, *seqs: Seq) -> None:
    for seq in seqs:
        decoder.cache.allocator.release(seq.table)


def text_prompt(seed: int, length: int) -> list[int]:
    return [(37 * seed + 11 * j) % 1000 for j in range(length)]


def chunked_batch_equals_hf(decoder, model) -> None:
    """Chunked prefill beside whole prompts and decodes, a prefill joining between decodes; every
    sampled row's logits are checked against HF's full forward."""
    a, b = new_seq(decoder, text_prompt(1, 11)), new_seq(decoder, text_prompt(2, 5))
    step(decoder, model, [(a, 6), (b, 5)])
    step(decoder, model, [(a, 5), (b, 1)])
    c = new_seq(decoder, text_prompt(3, 17))
    step(decoder, model, [(a, 1), (c, 17), (b, 1)])
    for _ in range(4):
        step(decoder, model, [(a, 1), (b, 1), (c, 1)])
    assert len(a.generated) == 6 and len(b.generated) == 7 and len(c.generated) == 5
    release(decoder, a, b, c)


def greedy_batch_equals_generate(decoder, model, new_tokens: int = 12) -> None:
    """Three prompts of different lengths prefilled together, then decoded together."""
    prompts = [text_prompt(4, 7), text_prompt(5, 19), text_prompt(6, 3)]
    seqs = [new_seq(decoder, prompt) for prompt in prompts]
    step(decoder, model, [(seq, len(seq.tokens)) for seq in seqs], check=False)
    for _ in range(new_tokens - 1):
        step(decoder, model, [(seq, 1) for seq in seqs], check=False)
    for prompt, seq in zip(prompts, seqs):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), do_sample=False,
                                      max_new_tokens=new_tokens)[0, len(prompt):].tolist()
        # generate stops after an EOS token (min_new_tokens would instead forbid it); the engine
        # driver here does not stop, so compare up to generate's end.
        assert seq.generated[:len(expected)] == expected
    assert len({t for seq in seqs for t in seq.generated}) > 3  # not a model stuck on one token
    release(decoder, *seqs)


# ---------------------------------------------------------------------------- text families


TEXT_MODELS = ["llama", "llama_tied", "qwen3", "mistral", "mistral_window8", "qwen2_5_vl"]


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_chunked_prefill_and_decode_batch_equals_hf(request, name):
    model = request.getfixturevalue(name)
    chunked_batch_equals_hf(make_decoder(model), model)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_greedy_batch_equals_hf_generate(request, name):
    model = request.getfixturevalue(name)
    greedy_batch_equals_generate(make_decoder(model), model)


def test_llama_family_uses_llama3_scaled_rotary(llama):
    family = family_for(llama)
    assert type(family) is QwenFamily and family.name == "llama"
    assert llama.model.rotary_emb.rope_type == "llama3"
    inv_freq = family.ropes[0][0]
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    # The fastest frequencies are kept, the slowest divided by the factor (8), some in between.
    assert torch.equal(inv_freq[:3], plain[:3]) and torch.allclose(inv_freq[-3:], plain[-3:] / 8)
    assert all(layer.qkv.bias is None and layer.gate_up.bias is None for layer in family.layers)


def test_mistral_window_applies_to_every_layer(mistral, mistral_window8):
    assert [layer.kind for layer in family_for(mistral).layers] == [FULL, FULL]
    family = family_for(mistral_window8)
    assert [layer.kind for layer in family.layers] == [SLIDING, SLIDING] and family.sliding_window == 8


def test_qwen3_family_norms_q_and_k_per_head(qwen3):
    family = family_for(qwen3)
    assert isinstance(family, Qwen3Family) and family.name == "qwen3"
    assert family.head_dim == 32 != qwen3.config.hidden_size // qwen3.config.num_attention_heads
    layer = family.layers[0]
    assert layer.qk_norm_w.shape == (4 + 2, 32) and layer.qkv.bias is None
    # Without the q/k norms the logits differ: the norms are not a no-op on this model.
    decoder = make_decoder(qwen3)
    prompt = text_prompt(7, 9)
    seq = new_seq(decoder, prompt)
    normed = decoder.forward([RowInput(prompt, 0, seq.table, True)])
    saved = [layer.qk_norm_w for layer in family.layers]
    try:
        for layer in decoder.layers:
            layer.qk_norm_w = None
        plain = decoder.forward([RowInput(prompt, 0, seq.table, True)])
    finally:
        for layer, weight in zip(decoder.layers, saved):
            layer.qk_norm_w = weight
    assert not torch.allclose(normed, plain, atol=1e-3)
    release(decoder, seq)


def test_unknown_model_type_is_refused(llama):
    class Unknown:
        model = type("Inner", (), {"config": type("Config", (), {"model_type": "falcon"})()})()

    with pytest.raises(ValueError, match="falcon"):
        family_for(Unknown())


# ---------------------------------------------------------------------------- Qwen2.5-VL media


@dataclass
class Item:
    """What vision.py reads from a validated item."""

    modality: str
    embed_positions: tuple[int, ...]
    grid_thw: tuple[int, int, int]
    encoder_inputs: dict
    second_per_grid_ts: float | None = None


def vl_prompt(seed: int, video_seconds: float | None):
    """Text, an image (grid 1 x 8 x 12: several vision windows), text, and with `video_seconds` a
    video (grid 3 x 4 x 4: 3 temporal steps); its items and HF's forward kwargs."""
    g = torch.Generator().manual_seed(seed)
    ids, items = [5, 6, 7, VISION_START], []
    grid = (1, 8, 12)
    pixels = torch.randn(96, 3 * 2 * 14 * 14, generator=g)
    offset = len(ids)
    ids += [IMAGE_PAD] * 24 + [VISION_END, 30, 31]
    items.append(Item("image", tuple(range(offset, offset + 24)), grid, {"pixel_values": pixels}))
    hf = {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}
    if video_seconds is not None:
        video_grid = (3, 4, 4)
        video = torch.randn(48, 3 * 2 * 14 * 14, generator=g)
        ids += [VISION_START]
        offset = len(ids)
        ids += [VIDEO_PAD] * 12 + [VISION_END]
        items.append(Item("video", tuple(range(offset, offset + 12)), video_grid, {"pixel_values_videos": video},
                          video_seconds))
        hf.update(pixel_values_videos=video, video_grid_thw=torch.tensor([video_grid]),
                  second_per_grid_ts=torch.tensor([video_seconds]))
    ids += [20, 21, 22]
    hf["mm_token_type_ids"] = vision.mm_token_type_ids(len(ids), items)
    return ids, items, hf


def vl_seq(decoder, model, seed, video_seconds):
    ids, items, hf = vl_prompt(seed, video_seconds)
    rows = vision.encode_items(model, items)
    mm = MultiModalPrefill.for_model(model.config, **vision.prefill_media(ids, list(zip(items, rows)), model.config))
    return new_seq(decoder, ids, mm, hf)


@pytest.mark.parametrize("seconds", [0.25, 1.0, 1.7])
def test_video_time_positions_equal_hf_rope_index(qwen2_5_vl, seconds):
    ids, items, hf = vl_prompt(0, seconds)
    positions, delta = vision.mrope_positions(ids, items, qwen2_5_vl.config)
    expected, expected_delta = qwen2_5_vl.model.get_rope_index(
        torch.tensor([ids]), hf["mm_token_type_ids"][None], hf["image_grid_thw"], hf["video_grid_thw"],
        second_per_grid_ts=hf["second_per_grid_ts"])
    assert torch.equal(positions, expected[:, 0])
    # Decoding continues one past the prompt's last position, as generate does; get_rope_index's
    # own delta counts from the largest position instead, which the video's time axis can pass.
    assert delta == int(expected[0, 0, -1]) + 1 - len(ids)
    assert (delta == int(expected_delta)) == (int(expected[0, 0].max()) == int(expected[0, 0, -1]))
    first = items[1].embed_positions[0]
    start = int(positions[1, first])  # the video's start position (its first row and column)
    # The time axis steps by int(k * tokens_per_second * seconds) (4 tokens per step), not by k.
    assert [int(positions[0, first + 4 * k]) - start for k in range(3)] == [int(k * 2 * seconds) for k in range(3)]


def test_image_and_video_prefill_chunked_beside_text_equal_hf(qwen2_5_vl):
    decoder = make_decoder(qwen2_5_vl)
    seq = vl_seq(decoder, qwen2_5_vl, seed=1, video_seconds=1.5)
    other = new_seq(decoder, text_prompt(9, 6))
    step(decoder, qwen2_5_vl, [(seq, 10), (other, 6)])  # the image's rows split across two chunks
    step(decoder, qwen2_5_vl, [(seq, len(seq.tokens) - 10), (other, 1)])
    for _ in range(6):
        step(decoder, qwen2_5_vl, [(other, 1), (seq, 1)])
    release(decoder, seq, other)


@pytest.mark.parametrize("video_seconds", [None, 0.5, 2.0])
def test_media_greedy_equals_hf_generate(qwen2_5_vl, video_seconds):
    decoder = make_decoder(qwen2_5_vl)
    seq = vl_seq(decoder, qwen2_5_vl, seed=2, video_seconds=video_seconds)
    other = new_seq(decoder, text_prompt(10, 13))
    step(decoder, qwen2_5_vl, [(seq, len(seq.tokens)), (other, 13)], check=False)
    for _ in range(9):
        step(decoder, qwen2_5_vl, [(seq, 1), (other, 1)], check=False)
    ids = torch.tensor([seq.tokens[:seq.prompt_len]])
    inputs = dict(seq.hf_inputs, mm_token_type_ids=seq.hf_inputs["mm_token_type_ids"][None])
    with torch.inference_mode():
        expected = qwen2_5_vl.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=10, **inputs)[0, seq.prompt_len:].tolist()
    assert len(expected) > 3 and seq.generated[:len(expected)] == expected
    release(decoder, seq, other)


def test_video_time_spacing_changes_the_output(qwen2_5_vl):
    decoder = make_decoder(qwen2_5_vl)
    slow, fast = (vl_seq(decoder, qwen2_5_vl, seed=3, video_seconds=s) for s in (0.25, 4.0))
    logits = decoder.forward([RowInput(s.tokens, 0, s.table, True, s.mm) for s in (slow, fast)])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)
    release(decoder, slow, fast)
