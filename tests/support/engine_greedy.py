"""Greedy decoding through a ModelRunner (all prompts batched in every step) and through HF
`generate` with its top-two logit gaps: the two sides the forward's equality tests compare."""

from __future__ import annotations

import torch

from tito_engine.model.forward import RowInput


def engine_greedy(runner, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all prompts batched in each step (one prefill, then decodes)."""
    block = runner.cache.block_size
    tables = [runner.cache.allocator.allocate(-(-(len(p) + new_tokens) // block)) for p in batch]
    logits = runner.execute([RowInput(p, 0, t, True) for p, t in zip(batch, tables)])
    outputs = [[int(token)] for token in logits.argmax(-1)]
    for step in range(1, new_tokens):
        rows = [RowInput([out[-1]], len(p) + step - 1, t, True) for p, out, t in zip(batch, outputs, tables)]
        for out, token in zip(outputs, runner.execute(rows).argmax(-1)):
            out.append(int(token))
    for table in tables:
        runner.cache.allocator.release(table)
    return outputs


def hf_greedy_with_gaps(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """HF generate's greedy tokens and, per step, the gap between its top two logits. EOS neither
    stops nor is banned (min_new_tokens would ban it and change the argmax): the raw argmax, as
    the engine's rows here."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True)
    gaps = [float(top[0] - top[1]) for top in (step[0].float().topk(2).values for step in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), gaps
