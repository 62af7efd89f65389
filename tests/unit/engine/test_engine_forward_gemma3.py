"""The batched paged-KV forward on Gemma3 (tiny-gemma3), checked against transformers 5.24 itself.

Every step's logits are compared with HF's full forward over the sequence so far (prefill in
chunks beside other rows, then decode), greedy loops with `generate`; images go through the
engine's own encoder path (vision.encode_items + prefill_media) against HF's forward with
pixel_values + token_type_ids. Variants built from the tiny model's weights exercise a sliding
window of 8 (shorter than an image's 16 soft tokens) and a text-only Gemma3ForCausalLM with final
logit soft-capping.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

from tito_engine.multimodal import vision
from tito_engine.model.families import FULL, SLIDING, Gemma3Family, QwenFamily, spans_of_runs
from tito_engine.model.forward import BatchedDecoder, MultiModalPrefill
from tito_engine.scheduling.plan import RowInput
from tito_engine.scheduling.spans import chunk_boundaries_ok, fit_chunk_end
from tito_engine.model.kv_cache import KVLayout, PagedKVCache

BOI, EOI, SOFT = 1013, 1014, 1015
ATOL = 1e-5
BLOCK = 4


@pytest.fixture(scope="module")
def gemma(tiny_interleaved_vl_model):
    return Gemma3ForConditionalGeneration.from_pretrained(tiny_interleaved_vl_model).eval()


@pytest.fixture(scope="module")
def gemma_window8(tiny_interleaved_vl_model):
    """The tiny Gemma3 with its sliding layer's window cut from 512 to 8."""
    config = Gemma3ForConditionalGeneration.config_class.from_pretrained(tiny_interleaved_vl_model)
    config.text_config.sliding_window = 8
    return Gemma3ForConditionalGeneration.from_pretrained(tiny_interleaved_vl_model, config=config).eval()


@pytest.fixture(scope="module")
def gemma_causal_lm(gemma):
    """A text-only Gemma3ForCausalLM (the head that soft-caps logits) with window 8, same weights."""
    config = copy.deepcopy(gemma.config.text_config)
    config.sliding_window = 8
    config.final_logit_softcapping = 2.0  # small enough to bend the tiny model's logits
    model = Gemma3ForCausalLM(config).eval()
    state = {f"model.{k}": v for k, v in gemma.model.language_model.state_dict().items()}
    state["lm_head.weight"] = gemma.lm_head.weight
    model.load_state_dict(state)
    return model


def make_decoder(model, num_blocks=96):
    text = model.config.get_text_config()
    layout = KVLayout(num_layers=text.num_hidden_layers, kv_heads=text.num_key_value_heads,
                      head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                      dtype=model.dtype)
    cache = PagedKVCache(layout, num_blocks, BLOCK, torch.device("cpu"))
    return BatchedDecoder(model, cache, max_positions=256)


# ---------------------------------------------------------------------------- a tiny driver


@dataclass
class Seq:
    """One sequence: its tokens (prompt + generated), how many are in the cache, its blocks."""

    tokens: list[int]
    prompt_len: int
    table: list[int]
    mm: MultiModalPrefill | None = None
    pixels: torch.Tensor | None = None
    types: torch.Tensor | None = None  # token_type_ids of the prompt
    cached: int = 0
    generated: list[int] = field(default_factory=list)


def hf_logits(model, seq: Seq) -> torch.Tensor:
    """HF's logits at every position of seq.tokens (full forward, no cache)."""
    ids = torch.tensor([seq.tokens])
    kwargs: dict[str, Any] = {}
    if seq.pixels is not None:
        types = torch.zeros(1, len(seq.tokens), dtype=torch.long)
        types[0, :seq.prompt_len] = seq.types
        kwargs = {"pixel_values": seq.pixels, "token_type_ids": types}
    with torch.inference_mode():
        return model(input_ids=ids, **kwargs).logits[0].float()


def step(decoder, model, work: list[tuple[Seq, int]], check: bool = True) -> None:
    """One batched forward: each (seq, count) computes its next `count` known tokens; rows that
    reach the end of their known tokens get logits, are checked against HF, and take the argmax."""
    rows, sampled = [], []
    for seq, count in work:
        chunk = seq.tokens[seq.cached:seq.cached + count]
        needs = seq.cached + count == len(seq.tokens)
        rows.append(RowInput(chunk, seq.cached, seq.table, needs, seq.mm))
        if needs:
            sampled.append(seq)
    logits = decoder.forward(rows)
    assert logits.shape[0] == len(sampled)
    for (seq, count) in work:
        seq.cached += count
    for row_logits, seq in zip(logits, sampled):
        if check:
            torch.testing.assert_close(row_logits, hf_logits(model, seq)[-1], atol=ATOL, rtol=0)
        token = int(row_logits.argmax())
        seq.tokens.append(token)
        seq.generated.append(token)


def new_seq(decoder, prompt, mm=None, pixels=None, types=None) -> Seq:
    blocks = decoder.cache.allocator.allocate(-(-(len(prompt) + 16) // BLOCK))
    return Seq(list(prompt), len(prompt), blocks, mm, pixels, types)


def release(decoder, *seqs: Seq) -> None:
    for seq in seqs:
        decoder.cache.allocator.release(seq.table)


def text_prompt(seed: int, length: int) -> list[int]:
    return [(37 * seed + 11 * j) % 1000 for j in range(length)]


# ---------------------------------------------------------------------------- text


def test_family_reads_gemma3_layer_math(gemma):
    decoder = make_decoder(gemma)
    family = decoder.family
    assert isinstance(family, Gemma3Family)
    assert [layer.kind for layer in family.layers] == [SLIDING, FULL] and family.sliding_window == 512
    assert family.scaling == 16 ** -0.5 and family.final_softcap is None  # the VLM head does not cap
    # Sliding layers read the local (10k) rotary base, full layers the global (1M) one.
    local, global_ = (decoder.rope_tables[layer.rope][1][1] for layer in family.layers)
    assert not torch.equal(local, global_)
    torch.testing.assert_close(family.embed(torch.tensor([5])), gemma.get_input_embeddings()(torch.tensor([5])),
                               atol=0, rtol=0)


def test_text_batch_with_chunked_prefill_and_decode_equals_hf(gemma):
    decoder = make_decoder(gemma)
    a, b = new_seq(decoder, text_prompt(1, 11)), new_seq(decoder, text_prompt(2, 5))
    step(decoder, gemma, [(a, 6), (b, 5)])  # a's first chunk (no logits) beside b's whole prompt
    step(decoder, gemma, [(a, 5), (b, 1)])  # a's second chunk reads its first from the cache
    c = new_seq(decoder, text_prompt(3, 17))
    step(decoder, gemma, [(a, 1), (c, 17), (b, 1)])  # a prefill between decodes
    for _ in range(4):
        step(decoder, gemma, [(a, 1), (b, 1), (c, 1)])
    assert len(a.generated) == 6 and len(b.generated) == 7 and len(c.generated) == 5
    release(decoder, a, b, c)


def test_text_greedy_equals_hf_generate(gemma):
    decoder = make_decoder(gemma)
    prompts = [text_prompt(4, 7), text_prompt(5, 13), text_prompt(6, 3)]
    seqs = [new_seq(decoder, prompt) for prompt in prompts]
    step(decoder, gemma, [(seq, len(seq.tokens)) for seq in seqs], check=False)
    for _ in range(9):
        step(decoder, gemma, [(seq, 1) for seq in seqs], check=False)
    for prompt, seq in zip(prompts, seqs):
        with torch.inference_mode():
            expected = gemma.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                      min_new_tokens=10)[0, len(prompt):]
        assert seq.generated == expected.tolist()
    release(decoder, *seqs)


def test_sliding_window_of_8_equals_hf(gemma_window8):
    model = gemma_window8
    decoder = make_decoder(model)
    assert decoder.sliding_window == 8
    a, b = new_seq(decoder, text_prompt(7, 21)), new_seq(decoder, text_prompt(8, 6))
    step(decoder, model, [(a, 10), (b, 6)])  # a's first chunk is longer than the window
    step(decoder, model, [(a, 11), (b, 1)])  # its second reads the cache, window across chunks
    for _ in range(6):
        step(decoder, model, [(a, 1), (b, 1)])
    # Decoding past the window agrees with HF's generate (its sliding-window cache) too.
    for seq in (a, b):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([seq.tokens[:seq.prompt_len]]), do_sample=False,
                                      max_new_tokens=len(seq.generated),
                                      min_new_tokens=len(seq.generated))[0, seq.prompt_len:]
        assert seq.generated == expected.tolist()
    release(decoder, a, b)


def test_causal_lm_head_soft_caps_logits_like_hf(gemma_causal_lm):
    model = gemma_causal_lm
    decoder = make_decoder(model)
    assert decoder.family.final_softcap == 2.0
    a, b = new_seq(decoder, text_prompt(9, 12)), new_seq(decoder, text_prompt(10, 4))
    step(decoder, model, [(a, 12), (b, 4)])
    for _ in range(5):
        step(decoder, model, [(a, 1), (b, 1)])
    assert float(decoder.forward([RowInput([a.tokens[-1]], a.cached, a.table, True)]).abs().max()) <= 2.0
    release(decoder, a, b)


# ---------------------------------------------------------------------------- images


@dataclass
class Item:
    """What vision.py reads from a validated item."""

    modality: str
    embed_positions: tuple[int, ...]
    grid_thw: None
    encoder_inputs: dict


def image_prompt(num_images: int, seed: int = 0):
    """Text, then per image `<boi> <soft>*16 <eoi>` and two text tokens; items and pixels."""
    g = torch.Generator().manual_seed(seed)
    ids, items, pixels = [5, 6, 7], [], []
    for k in range(num_images):
        pixel = torch.randn(1, 3, 64, 64, generator=g)
        offset = len(ids)
        ids += [BOI] + [SOFT] * 16 + [EOI] + [30 + k, 40 + k]
        items.append(Item("image", tuple(range(offset + 1, offset + 17)), None, {"pixel_values": pixel}))
        pixels.append(pixel)
    ids += [20, 21, 22]
    return ids, items, torch.cat(pixels)


def image_seq(decoder, model, num_images, seed):
    ids, items, pixels = image_prompt(num_images, seed)
    rows = vision.encode_items(model, items)
    mm = MultiModalPrefill(**vision.prefill_media(ids, list(zip(items, rows)), model.config))
    return new_seq(decoder, ids, mm, pixels, vision.embed_token_type_ids(len(ids), items))


@pytest.mark.parametrize("num_images", [1, 2])
def test_image_prefill_and_greedy_decode_equal_hf(gemma, num_images):
    decoder = make_decoder(gemma)
    seq = image_seq(decoder, gemma, num_images, seed=num_images)
    other = new_seq(decoder, text_prompt(11, 9))
    # Chunks cut only outside image spans: [0, 3) text, then the rest (spans whole) beside a text row.
    assert chunk_boundaries_ok(seq.mm, 0, 3) and not chunk_boundaries_ok(seq.mm, 0, 10)
    step(decoder, gemma, [(seq, 3), (other, 9)])
    step(decoder, gemma, [(seq, len(seq.tokens) - 3), (other, 1)])
    assert seq.mm.bidirectional_spans == [(4 + 20 * k, 20 + 20 * k) for k in range(num_images)]
    for _ in range(7):
        step(decoder, gemma, [(other, 1), (seq, 1)])
    with torch.inference_mode():
        expected = gemma.generate(input_ids=torch.tensor([seq.tokens[:seq.prompt_len]]), pixel_values=seq.pixels,
                                  token_type_ids=seq.types[None], do_sample=False, max_new_tokens=8,
                                  min_new_tokens=8)[0, seq.prompt_len:]
    assert seq.generated == expected.tolist()
    release(decoder, seq, other)


def test_image_span_longer_than_the_sliding_window_equals_hf(gemma_window8):
    # 16 soft tokens under a window of 8: sliding layers attend AND(window, OR(causal, span)).
    model = gemma_window8
    decoder = make_decoder(model)
    seq = image_seq(decoder, model, 2, seed=3)
    step(decoder, model, [(seq, 23)])  # text + first image + 2 text tokens: cut between spans
    step(decoder, model, [(seq, len(seq.tokens) - 23)])
    for _ in range(5):
        step(decoder, model, [(seq, 1)])
    release(decoder, seq)


def test_bidirectional_spans_change_the_output(gemma):
    # Without the span the image tokens attend causally: HF's forward without token_type_ids.
    decoder = make_decoder(gemma)
    seq = image_seq(decoder, gemma, 1, seed=5)
    causal = MultiModalPrefill(seq.mm.embeds, seq.mm.embed_positions, bidirectional_spans=[])
    logits = decoder.forward([RowInput(seq.tokens, 0, seq.table, True, causal)])
    with torch.inference_mode():
        plain = gemma(input_ids=torch.tensor([seq.tokens]), pixel_values=seq.pixels).logits[0, -1]
        with_types = gemma(input_ids=torch.tensor([seq.tokens]), pixel_values=seq.pixels,
                           token_type_ids=seq.types[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], plain, atol=ATOL, rtol=0)
    assert not torch.allclose(plain, with_types, atol=1e-3)
    release(decoder, seq)


# ---------------------------------------------------------------------------- chunking rule


def test_chunk_rule_helpers():
    mm = MultiModalPrefill(embed_positions=torch.tensor([4, 5, 6, 7, 10, 11]), bidirectional_spans=[(4, 8), (10, 12)])
    assert chunk_boundaries_ok(mm, 0, 4) and chunk_boundaries_ok(mm, 4, 8) and chunk_boundaries_ok(mm, 8, 11) is False
    assert chunk_boundaries_ok(None, 0, 5) and chunk_boundaries_ok(MultiModalPrefill(bidirectional_spans=[]), 0, 5)
    assert fit_chunk_end(mm, 0, 6) == 4  # back to the span's start
    assert fit_chunk_end(mm, 4, 6) == 8  # the span starts the chunk: take all of it (over budget)
    assert fit_chunk_end(mm, 0, 9) == 9 and fit_chunk_end(mm, 8, 11) == 10
    # Unresolved spans: every run of embed positions is protected (never wrong).
    unresolved = MultiModalPrefill(embed_positions=torch.tensor([2, 3, 4]))
    assert not chunk_boundaries_ok(unresolved, 0, 3) and fit_chunk_end(unresolved, 0, 3) == 2
    assert spans_of_runs(torch.tensor([1, 2, 5, 6, 7, 9])) == [(1, 3), (5, 8), (9, 10)]


def test_spans_resolve_per_family(gemma, tiny_vl_model):
    from transformers import Qwen2VLForConditionalGeneration

    positions = torch.tensor([3, 4, 5])
    assert MultiModalPrefill.for_model(gemma.config, embed_positions=positions).bidirectional_spans == [(3, 6)]
    qwen = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_model).eval()
    assert MultiModalPrefill.for_model(qwen.config, embed_positions=positions).bidirectional_spans == []
    decoder = make_decoder(qwen)
    assert isinstance(decoder.family, QwenFamily) and decoder.family.name == "qwen2_vl"
    assert decoder.prepare_prefill(MultiModalPrefill(embed_positions=positions)).bidirectional_spans == []
