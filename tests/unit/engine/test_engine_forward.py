"""The batched forward and the paged KV cache, checked against Hugging Face's own forward.

Includes the multimodal seam on the tiny Qwen2-VL: encoder rows replacing placeholder
embeddings, explicit 3-D M-RoPE positions at prefill, and `cache_len + rope_delta` decode
positions, each equal to HF's language model given the same inputs_embeds and position ids.
"""

import pytest
import torch

from tito_engine.model.forward import MultiModalPrefill
from tito_engine.scheduling.blocks import BlockAllocator, blocks_for_tokens
from tito_engine.scheduling.plan import RowInput
from tito_engine.model.runner import KVCacheSpec, ModelRunner

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def vl_runner(tiny_vl_model):
    return ModelRunner(tiny_vl_model, model_id="tiny-qwen2-vl", device="cpu",
                       kv_cache=KVCacheSpec(num_blocks=32, block_size=4))


def test_block_allocator_reference_counts():
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert allocator.num_free == 1 and len(set(first)) == 3
    allocator.share(first[:2])
    allocator.release(first)
    assert allocator.num_free == 2  # the shared two are still held
    allocator.release(first[:2])
    assert allocator.num_free == 4
    with pytest.raises(AssertionError):
        allocator.release(first[:1])
    with pytest.raises(MemoryError):
        allocator.allocate(5)
    assert blocks_for_tokens(0, 4) == 0 and blocks_for_tokens(4, 4) == 1 and blocks_for_tokens(5, 4) == 2


def test_vl_text_prompt_greedy_equals_hf_generate(vl_runner):
    model = vl_runner.model
    with torch.inference_mode():
        expected = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8,
                                  mm_token_type_ids=torch.zeros(1, len(PROMPT), dtype=torch.long))[0, len(PROMPT):]
    blocks = vl_runner.cache.allocator.allocate(4)
    tokens, produced = list(PROMPT), []
    logits = vl_runner.execute([RowInput(tokens, 0, blocks, True)])
    for _ in range(8):
        token = int(logits[0].argmax())
        produced.append(token)
        tokens.append(token)
        logits = vl_runner.execute([RowInput([token], len(tokens) - 1, blocks, True)])
    vl_runner.cache.allocator.release(blocks)
    assert produced == expected.tolist()


def _hf_logits(model, embeds, positions):
    text = model.model.language_model
    with torch.inference_mode():
        hidden = text(inputs_embeds=embeds, position_ids=positions[:, None, :]).last_hidden_state
        return model.lm_head(hidden)[0]


def test_embedding_overrides_and_mrope_positions_equal_hf(vl_runner):
    model = vl_runner.model
    text = model.model.language_model
    rows = torch.randn(2, text.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = text.embed_tokens(torch.tensor([PROMPT])).clone()
    embeds[0, 2:4] = rows
    # Positions as an image span would give them (t, h, w differ inside the span); rope_delta -1.
    mrope = torch.tensor([[0, 1, 2, 2, 3, 4, 5], [0, 1, 2, 2, 3, 4, 5], [0, 1, 2, 3, 3, 4, 5]])
    mm = MultiModalPrefill(embeds=rows, embed_positions=torch.tensor([2, 3]), mrope_positions=mrope, rope_delta=-1)
    expected = _hf_logits(model, embeds, mrope)

    # Prefill in two chunks that split the media span, beside an unrelated text row.
    allocator = vl_runner.cache.allocator
    blocks, other = allocator.allocate(3), allocator.allocate(2)
    first = vl_runner.execute([RowInput(PROMPT[:3], 0, blocks, False, mm), RowInput([9, 9, 9], 0, other, True)])
    assert first.shape[0] == 1
    logits = vl_runner.execute([RowInput(PROMPT[3:], 3, blocks, True, mm)])
    assert torch.allclose(logits[0], expected[-1], atol=1e-4)

    # Decode: the next token sits at cache_len + rope_delta in all three sections.
    token = int(logits[0].argmax())
    with torch.no_grad():
        step_embeds = torch.cat([embeds, text.embed_tokens(torch.tensor([[token]]))], dim=1)
    step_positions = torch.cat([mrope, torch.full((3, 1), len(PROMPT) - 1)], dim=1)
    decoded = vl_runner.execute([RowInput([token], len(PROMPT), blocks, True, mm)])
    assert torch.allclose(decoded[0], _hf_logits(model, step_embeds, step_positions)[-1], atol=1e-4)
    allocator.release(blocks)
    allocator.release(other)

    dense = torch.zeros(len(PROMPT), text.config.hidden_size)
    dense[2:4] = rows
    mask = torch.zeros(len(PROMPT), dtype=torch.bool)
    mask[2:4] = True
    from_dense = MultiModalPrefill.from_dense(dense, mask, mrope_positions=mrope, rope_delta=-1)
    assert from_dense.embed_positions.tolist() == [2, 3] and torch.equal(from_dense.embeds, rows)


def test_a_step_may_pack_more_tokens_than_one_context(tiny_text_model):
    # Context 24 with blocks of 5 (not a divisor): 3 prompts of 20 tokens in one step = 60 tokens.
    runner = ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu", max_model_len=24,
                         kv_cache=KVCacheSpec(num_blocks=32, block_size=5))
    prompts = [[(7 * i + j) % 1000 for j in range(20)] for i in range(3)]
    tables = [runner.cache.allocator.allocate(5) for _ in prompts]
    logits = runner.execute([RowInput(prompt, 0, table, True) for prompt, table in zip(prompts, tables)])
    with torch.inference_mode():
        expected = runner.model(torch.tensor(prompts)).logits[:, -1]
    assert torch.allclose(logits, expected, atol=1e-4)
    # Then decode to the end of the context (24 tokens: the last block is partly past it).
    tokens = [prompt + [int(logits[i].argmax())] for i, prompt in enumerate(prompts)]
    for _ in range(3):
        logits = runner.execute([RowInput([seq[-1]], len(seq) - 1, table, True) for seq, table in zip(tokens, tables)])
        for i, seq in enumerate(tokens):
            seq.append(int(logits[i].argmax()))
    with torch.inference_mode():
        reference = runner.model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=4, min_new_tokens=4)
    assert [seq[20:] for seq in tokens] == reference[:, 20:].tolist()


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["torch-path", "cpu-kernel"])
def test_qwen2_sliding_window_layers_equal_hf(tiny_text_model, decode_kernel):
    # Qwen2 with use_sliding_window: layers from max_window_layers on slide (window 6 here), the
    # same masks the Gemma3 family uses; prefill in chunks longer than the window, then decode
    # (on the torch path and in the CPU decode kernel).
    from transformers import AutoConfig, Qwen2ForCausalLM

    from tito_engine.model.cpu_attention import load_attention_kernel

    from tito_engine.model.forward import BatchedDecoder
    from tito_engine.model.kv_cache import KVLayout, PagedKVCache

    config = AutoConfig.from_pretrained(tiny_text_model)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 6, 1
    config.layer_types = ["full_attention", "sliding_attention"]  # what max_window_layers=1 gives
    model = Qwen2ForCausalLM.from_pretrained(tiny_text_model, config=config).eval()
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float32)
    kernel = load_attention_kernel() if decode_kernel else None
    assert kernel is not None or not decode_kernel
    decoder = BatchedDecoder(model, PagedKVCache(layout, 16, 4, torch.device("cpu")), max_positions=64,
                             attention_kernel=kernel)
    prompt = [(13 * j + 5) % 1000 for j in range(15)]
    blocks = decoder.cache.allocator.allocate(8)
    decoder.forward([RowInput(prompt[:9], 0, blocks, False)])
    tokens = list(prompt)
    logits = decoder.forward([RowInput(prompt[9:], 9, blocks, True)])
    for _ in range(6):
        with torch.inference_mode():
            expected = model(torch.tensor([tokens])).logits[0, -1]
        assert torch.allclose(logits[0], expected, atol=1e-5)
        tokens.append(int(logits[0].argmax()))
        logits = decoder.forward([RowInput([tokens[-1]], len(tokens) - 1, blocks, True)])
