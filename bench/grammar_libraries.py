"""Compare the grammar libraries the engine could build token masks with, on the tiny model's tokenizer.

For each of llguidance, xgrammar and outlines_core: the time to compile a typical JSON schema
(an object with nested object, array, enum and required fields: what a router's response_format
looks like) into something that yields masks, and the per-step cost at batch 32 of filling the
32 rows' masks and advancing each matcher by one allowed token (what a decode step adds).
Times are medians over rounds; the tokenizer conversion (done once per engine) is not counted.

    python bench/grammar_libraries.py [--rounds 5] [--steps 64]
    python bench/grammar_libraries.py --smoke   # one round of 2 steps; a library that fails fails the run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
BATCH = 32


def _tokenizer():
    from transformers import AutoTokenizer

    from tito_models.tiny import TEXT_MODEL, ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model(TEXT_MODEL)))


def _pick_allowed(mask_row: torch.Tensor, vocab: int, generator: torch.Generator) -> int:
    bits = ((mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    allowed = bits.nonzero().flatten()
    return int(allowed[torch.randint(len(allowed), (1,), generator=generator)])


def _steps(fill, advance, reset, vocab: int, steps: int) -> float:
    """Median seconds per step of fill (all rows) + advance (all rows)."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fill(mask)
        times.append(time.perf_counter() - start)
        tokens = [_pick_allowed(mask[i], vocab, generator) for i in range(BATCH)]
        start = time.perf_counter()
        advance(tokens)
        times[-1] += time.perf_counter() - start
        reset()
    return statistics.median(times)


def bench_llguidance(tokenizer, steps: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    executor = llguidance.LLExecutor(num_threads=1)  # as xgrammar's batch matcher on 2 cores
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    first = llguidance.LLMatcher(lltok, grammar)
    first.compute_bitmask()  # the first mask does the lazy work
    compile_s = time.perf_counter() - start
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]

    def fill(mask):
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def advance(tokens):
        for m, t in zip(matchers, tokens):
            m.consume_token(t)

    def reset():
        for i, m in enumerate(matchers):
            if m.is_stopped() or m.is_error():
                matchers[i] = llguidance.LLMatcher(lltok, grammar)

    return compile_s, _steps(fill, advance, reset, len(tokenizer), steps)


def bench_xgrammar(tokenizer, steps: int) -> tuple[float, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(BATCH)]
    batch = xgrammar.BatchGrammarMatcher()

    def fill(mask):
        batch.batch_fill_next_token_bitmask(matchers, mask)

    def advance(tokens):
        for m, t in zip(matchers, tokens):
            m.accept_token(t)

    def reset():
        for i, m in enumerate(matchers):
            if m.is_terminated():
                matchers[i] = xgrammar.GrammarMatcher(compiled)

    return compile_s, _steps(fill, advance, reset, len(tokenizer), steps)


def bench_outlines(tokenizer, steps: int) -> tuple[float, float]:
    import outlines_core

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces: dict[str, list[int]] = {}
    for token_id in range(len(tokenizer)):
        if token_id in tokenizer.all_special_ids:
            continue
        pieces.setdefault(tokenizer.decode([token_id]), []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, pieces)
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - start
    guides = [outlines_core.Guide(index) for _ in range(BATCH)]

    def fill(mask):
        for i, guide in enumerate(guides):
            row = mask[i]
            guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(tokens):
        for guide, t in zip(guides, tokens):
            guide.advance(t)

    def reset():
        for i, guide in enumerate(guides):
            if guide.is_finished():
                guides[i] = outlines_core.Guide(index)

    return compile_s, _steps(fill, advance, reset, len(tokenizer), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 2
    torch.set_num_threads(1)
    tokenizer = _tokenizer()
    libraries = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines_core": bench_outlines}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in libraries}
    for _ in range(args.rounds):  # interleaved rounds: a noisy neighbour hits every library alike
        for name, run in libraries.items():
            try:
                results[name].append(run(tokenizer, args.steps))
            except Exception as exc:  # noqa: BLE001 - report a library that cannot do it, go on
                if args.smoke:  # the bench's own code broke, or a library's interface changed under it
                    raise
                print(f"{name}: failed: {type(exc).__name__}: {exc}")
    for name, rows in results.items():
        if rows:
            compile_ms = statistics.median(r[0] for r in rows) * 1000
            step_us = statistics.median(r[1] for r in rows) * 1e6
            print(f"{name:14s} compile {compile_ms:8.2f} ms   mask+advance at batch {BATCH}: {step_us:8.1f} us/step")


if __name__ == "__main__":
    main()
