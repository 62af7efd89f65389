"""Structured outputs in the native engine: a random-weight model's output parses and validates."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tito.errors import InvalidArgument
from tito_engine.backend.admission import Admission
from tito_engine.model.constraints import INVALID_STRUCTURED_OUTPUT, StructuredOutputSpec, validate
from tito_engine.core.engine import Engine
from tito_engine.limits import SchedulerLimits
from tito_engine.model.runner import ModelRunner
from tito_engine.request import FinishReason, GenerateInput, RawSamplingParams

MAX_TOKENS = 256
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def runner(tiny_text_model):
    return ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


@pytest.fixture(scope="module")
def engine(runner):
    engine = Engine(runner, limits=SchedulerLimits(max_running_sequences=32), max_waiting_requests=4096)
    engine.start()
    yield engine
    engine.stop()


def request(spec, temperature=0.0, seed=None, prompt=PROMPT, **sampling):
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return GenerateInput("", list(prompt), RawSamplingParams(temperature=temperature, seed=seed,
                                                             structured_output=spec, **sampling))


async def generate(engine, generate_input):
    tokens, last, logprobs = [], None, []
    async for output in engine.generate(Admission.for_backend(engine).admit(generate_input)):
        tokens.extend(output.token_ids)
        logprobs.extend(output.logprobs)
        last = output
    last.logprobs = tuple(logprobs)  # every position's, for the tests that ask
    return tokens, last


def run_all(engine, inputs):
    async def main():
        return await asyncio.gather(*(generate(engine, item) for item in inputs))
    return asyncio.run(main())


# ------------------------------------------------------------------ schema generator

_FORMATS = ("date", "uuid")  # bounded; xgrammar's ipv4 admits leading zeros, which jsonschema refuses


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "string", "integer", "boolean", "null", "enum", "format"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "format":
        return {"type": "string", "format": rng.choice(_FORMATS)}
    return {"type": kind}


def _value(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.45:
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "kind", "size", "owner", "ok", "when", "addr", "note"], rng.randint(1, 4))
    properties = {name: _value(rng, depth) for name in names}
    return {"type": "object", "properties": properties,
            "required": [name for name in names if rng.random() < 0.7], "additionalProperties": False}


def generated_schemas(count: int = 100, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng) for _ in range(count)]


def syntactic_format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checks, except that a date is checked for syntax (RFC 3339 full-date: month
    01-12, day 01-31) like xgrammar does, not against the calendar (2023-02-29 passes)."""
    checker = jsonschema.FormatChecker()
    checker.checks("date")(lambda value: not isinstance(value, str) or bool(
        re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", value)))
    return checker


def _decode(tokenizer, tokens, last):
    assert last.finish_reason is FinishReason.STOP, "a constrained output ran into max_tokens"
    return tokenizer.decode(tokens, skip_special_tokens=True)


_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


def _decode_as_xgrammar_counts(tokenizer, tokens, last) -> str:
    """The output's bytes as text, a UTF-8-encoded surrogate (ED A0..BF xx) kept as the one
    character xgrammar counts it as. xgrammar's string rules admit such sequences, which are not
    valid UTF-8: decoded strictly they become three U+FFFD, so a sampled output can exceed a
    schema's maxLength by that count (a known gap of the grammar backend, not of sampling)."""
    assert last is None or last.finish_reason is FinishReason.STOP, "a constrained output ran into max_tokens"
    pieces = tokenizer.convert_ids_to_tokens([token for token in tokens if token not in tokenizer.all_special_ids])
    return bytes(_BYTE_OF_CHAR[char] for piece in pieces for char in piece).decode("utf-8", errors="surrogatepass")


# ------------------------------------------------------------------ behaviour

def test_unconstrained_output_of_the_random_model_is_not_json(engine, tokenizer):
    (tokens, _), = run_all(engine, [request(None, max_tokens=40)])
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(tokens, skip_special_tokens=True))


def test_one_hundred_generated_schemas_validate_greedy_and_sampled(engine, tokenizer):
    schemas = generated_schemas()
    specs = [StructuredOutputSpec("json_schema", json.dumps(schema)) for schema in schemas]
    greedy = [request(spec) for spec in specs]
    sampled = [request(spec, temperature=1.0, seed=i) for i, spec in enumerate(specs)]
    inputs = greedy + sampled
    results = run_all(engine, inputs)
    checker = syntactic_format_checker()
    for i, (tokens, last) in enumerate(results):
        schema = schemas[i % len(schemas)]
        value = json.loads(_decode_as_xgrammar_counts(tokenizer, tokens, last))
        jsonschema.validate(value, schema, format_checker=checker)
    sampled = [tuple(tokens) for tokens, _ in results[len(schemas):]]
    assert len(set(sampled)) > len(schemas) // 2  # sampling, not one fixed answer per schema


def test_regex_and_choice_constraints(engine, tokenizer):
    pattern = r"[a-z]{2,5}-\d{2}(\.[A-Z]+)?"
    choices = ["alpha", "beta", "gamma delta", "ε-épsilon"]
    inputs = []
    for seed in range(20):
        inputs.append(request(StructuredOutputSpec("regex", pattern), temperature=1.0, seed=seed))
        # Hot: at 1.0 the random model puts ~97% on one choice, and which seeds see another is luck.
        inputs.append(request(StructuredOutputSpec.choice(choices), temperature=4.0, seed=seed))
    results = run_all(engine, inputs)
    seen_choices = set()
    for k, (tokens, last) in enumerate(results):
        text = _decode(tokenizer, tokens, last)
        if k % 2 == 0:
            assert re.fullmatch(pattern, text), text
        else:
            assert text in choices
            seen_choices.add(text)
    assert len(seen_choices) > 1


def test_any_json_object_parses_where_it_finishes(engine, tokenizer):
    # Any object is unbounded: a random model may keep one string open past max_tokens, so only
    # the outputs that finished (most of them) are checked, and the rest must still be a prefix.
    inputs = [request(StructuredOutputSpec("json_object"), prompt=[9 + i, 30, 31], max_tokens=300) for i in range(20)]
    finished = 0
    for tokens, last in run_all(engine, inputs):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert text.startswith("{")
        if last.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
            finished += 1
    assert finished >= 10


def test_a_complete_structure_stops_and_unconstrained_rows_are_untouched(engine, tokenizer):
    alone = run_all(engine, [request(None, max_tokens=24, ignore_eos=True)])[0][0]
    mixed = run_all(engine, [request(StructuredOutputSpec.choice(["yes"])),
                             request(None, max_tokens=24, ignore_eos=True),
                             request(StructuredOutputSpec("regex", "ab"), ignore_eos=True)])
    (yes_tokens, yes_last), (plain_tokens, _), (ab_tokens, ab_last) = mixed
    assert plain_tokens == alone  # masks touch only the constrained rows
    assert tokenizer.decode(yes_tokens, skip_special_tokens=True) == "yes"
    assert yes_last.finish_reason is FinishReason.STOP and yes_last.matched_stop_token_id is not None
    assert tokenizer.decode(ab_tokens, skip_special_tokens=True) == "ab"
    assert ab_last.finish_reason is FinishReason.STOP  # ignore_eos cannot outlive the grammar


def test_logprobs_of_a_constrained_row_are_the_raw_model_distribution(engine):
    (tokens, last), = run_all(engine, [request(StructuredOutputSpec.choice(["zzzz"]), logprobs=True, max_tokens=8)])
    assert last.finish_reason is FinishReason.STOP
    assert [position.sampled.token_id for position in last.logprobs] == tokens
    # One allowed token per step: under the masked distribution each would have logprob 0.
    assert all(position.sampled.logprob < -1e-3 for position in last.logprobs)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 11)])
def test_a_migrated_constrained_choice_continues_where_its_grammar_stopped(engine, tokenizer, temperature, seed):
    """Request migration: prompt + the first k output ids, prior_output_tokens=k, the rest of
    the budget. The engine advances the grammar over those ids, so the continuation (greedy, and
    seeded: each draw keyed by its output position) is the uninterrupted choice's tail, and the
    whole output still validates."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "size"], "additionalProperties": False}
    spec = StructuredOutputSpec("json_schema", json.dumps(schema))
    (whole, last), = run_all(engine, [request(spec, temperature=temperature, seed=seed)])
    assert last.finish_reason is FinishReason.STOP and len(whole) > 4
    cuts = (1, len(whole) // 2, len(whole) - 1)
    tails = run_all(engine, [request(spec, temperature=temperature, seed=seed, prompt=PROMPT + whole[:cut],
                                     prior_output_tokens=cut, max_tokens=MAX_TOKENS - cut) for cut in cuts])
    assert [tokens for tokens, _ in tails] == [whole[cut:] for cut in cuts]
    jsonschema.validate(json.loads(_decode(tokenizer, whole, last)), schema)


def test_a_migrated_choice_whose_output_breaks_its_grammar_is_refused(engine, tokenizer):
    spec = StructuredOutputSpec("regex", "[0-9]{3}")
    letters = tokenizer.encode("abc", add_special_tokens=False)

    async def main():
        admitted = Admission.for_backend(engine).admit(request(spec, prompt=PROMPT + letters,
                                                               prior_output_tokens=len(letters)))
        return [output async for output in engine.generate(admitted)]

    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(main())
    assert caught.value.field == "sampling_params.prior_output_tokens" and "refuses token" in caught.value.message
    assert engine.load().waiting_requests == 0 and engine.load().running_requests == 0
    (digits, _), = run_all(engine, [request(spec, max_tokens=8)])  # the engine goes on
    assert tokenizer.decode(digits, skip_special_tokens=True).isdigit()


@pytest.mark.parametrize("spec, field, fragment", [
    (StructuredOutputSpec("json_schema", '{"type": "strin"}'), "json_schema", "Unsupported type"),
    (StructuredOutputSpec("json_schema", "{not json"), "json_schema", "Failed to parse JSON"),
    (StructuredOutputSpec("regex", "a(b"), "regex", "parenthesis is not closed"),
    (StructuredOutputSpec("grammar", 'root ::= bar'), "grammar", 'Rule "bar" is not defined'),
    (StructuredOutputSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "tagz"}}'),
     "structural_tag", "tagz"),
    (StructuredOutputSpec.choice([]), "choice.choices", "at least one"),
    (StructuredOutputSpec.choice(["a", ""]), "choice.choices[1]", "non-empty"),
])
def test_invalid_constraints_are_refused_with_the_compilers_message(engine, spec, field, fragment):
    with pytest.raises(InvalidArgument) as caught:
        Admission.for_backend(engine).admit(request(spec))
    error = caught.value
    assert error.reason == INVALID_STRUCTURED_OUTPUT
    assert error.violations[0].field == f"sampling_params.structured_output.{field}"
    assert fragment in error.message and "/project/" not in error.message
    assert engine.load().waiting_requests == 0


def test_a_compile_failure_in_the_core_is_refused_before_scheduling(engine, monkeypatch):
    import tito_engine.model.constraints as constraints

    spec = StructuredOutputSpec("regex", "[0-9]{3}")
    admitted = Admission.for_backend(engine).admit(request(spec))
    validate(spec)

    def broken(_spec):
        raise RuntimeError("[12:00:00] /project/cpp/x.cc:1: boom")

    monkeypatch.setattr(constraints, "grammar_of", broken)
    engine._core.core.grammars._cache.clear()

    async def main():
        return [output async for output in engine.generate(admitted)]

    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(main())
    assert caught.value.reason == INVALID_STRUCTURED_OUTPUT and "boom" in caught.value.message


def test_a_request_aborted_while_its_grammar_compiles_ends_with_abort(engine, monkeypatch):
    import threading

    import tito_engine.model.constraints as constraints

    release = threading.Event()
    real = constraints.grammar_of

    def slow(spec):
        release.wait(10)
        return real(spec)

    monkeypatch.setattr(constraints, "grammar_of", slow)
    spec = StructuredOutputSpec("regex", "[0-9]{5}")
    engine._core.core.grammars._cache.clear()
    delivered = []
    request_input = request(spec)
    request_input.request_id = "parked"
    engine.submit(Admission.for_backend(engine).admit(request_input), delivered.append)
    for _ in range(200):
        if engine.load().waiting_requests == 1:  # parked, counted as waiting
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.load().waiting_requests == 1
    assert engine.abort(["parked"]) == ["parked"]
    for _ in range(200):
        if delivered:
            break
        asyncio.run(asyncio.sleep(0.01))
    release.set()
    assert len(delivered) == 1 and delivered[0].finish_reason is FinishReason.ABORT


def test_choices_and_preempted_requests_keep_their_structure(tiny_text_model, tokenizer):
    from tito_engine.model.runner import KVCacheSpec

    # 96 blocks of 8 tokens: 14 choices of ~100 tokens each cannot all stay; some are preempted
    # mid-structure and recompute prompt + output before their matcher takes the next token.
    small = ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu", max_model_len=512,
                        kv_cache=KVCacheSpec(num_blocks=96, block_size=8))
    engine = Engine(small, limits=SchedulerLimits(max_running_sequences=16))
    engine.start()
    try:
        schemas = generated_schemas(12, seed=3)
        inputs = [request(StructuredOutputSpec("json_schema", json.dumps(schema)), temperature=1.0, seed=i,
                          n=3 if i == 0 else None, max_tokens=200 if i == 0 else 320,  # room for 4 uuids
                          prompt=list(range(5 + i, 60 + i)))
                  for i, schema in enumerate(schemas)]

        async def choices(generate_input):
            per_choice: dict[int, list[int]] = {}
            finish = {}
            async for output in engine.generate(Admission.for_backend(engine).admit(generate_input)):
                per_choice.setdefault(output.index, []).extend(output.token_ids)
                if output.finish_reason is not None:
                    finish[output.index] = output.finish_reason
            return per_choice, finish

        async def main():
            return await asyncio.gather(*(choices(item) for item in inputs))

        results = asyncio.run(main())
        assert engine._core.core.scheduler.preemptions > 0
    finally:
        engine.stop()
    assert len(results[0][0]) == 3
    for schema, (per_choice, finish) in zip(schemas, results):
        for index, tokens in per_choice.items():
            assert finish[index] is FinishReason.STOP
            jsonschema.validate(json.loads(_decode_as_xgrammar_counts(tokenizer, tokens, None)), schema,
                                format_checker=syntactic_format_checker())


def test_a_model_without_tokenizer_files_refuses_constrained_requests(tmp_path):
    from tito.errors import FailedPrecondition
    from tito_engine.model.constraints import GrammarCompiler, compile_error

    spec = StructuredOutputSpec("regex", "[a-z]")
    error = GrammarCompiler(tmp_path, 1013, [1000]).submit(spec).exception(timeout=60)
    refused = compile_error(error, spec)
    assert isinstance(refused, FailedPrecondition) and refused.reason == "STRUCTURED_OUTPUT_UNAVAILABLE"


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_masks_apply_like_xgrammars_kernel_on_the_constrained_rows_only(rows):
    """TokenMasks applies the bitmask with torch on CPU: the same logits as xgrammar's kernel."""
    import torch
    import xgrammar

    from tito_engine.model.constraints import TokenMasks

    vocab = 1013  # not a multiple of 32: the last word's padding bits are ignored
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, vocab, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    TokenMasks(vocab)._apply_on_cpu(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    untouched = [row for row in range(4) if row not in rows]
    assert not torch.isinf(logits[untouched]).any()
