"""The continuous-batching scheduler with the tiny text model and the paged KV cache.

Greedy output equals HF generate alone and inside a batch of 16 requests of different lengths
joining at different steps; chunked prefill, preemption under a tiny cache, n > 1 forks, aborts
and seeds are checked against the same reference.
"""

import collections
import random

import pytest
import torch

from tito_engine.limits import SchedulerLimits
from tito_engine.model.runner import KVCacheSpec, ModelRunner
from tito_engine.request import FinishReason, Request, SamplingOptions
from tito_engine.scheduling.scheduler import Scheduler, run_step

PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 17], [42]]


def _runner(model, **spec):
    return ModelRunner(model, model_id="tiny-qwen2", device="cpu", kv_cache=KVCacheSpec(**spec))


@pytest.fixture(scope="module")
def runner(tiny_text_model):
    return _runner(tiny_text_model, num_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def tiny_cache_runner(tiny_text_model):
    # 12 blocks of 4 tokens: 48 token slots for the whole engine.
    return _runner(tiny_text_model, num_blocks=12, block_size=4)


_HF_CACHE: dict = {}


def hf_greedy(runner, prompt, max_new_tokens):
    key = (tuple(prompt), max_new_tokens)
    if key not in _HF_CACHE:
        with torch.inference_mode():
            output = runner.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
        _HF_CACHE[key] = output[0, len(prompt):].tolist()
    return _HF_CACHE[key]


def scheduler_over(runner, **settings) -> Scheduler:
    """A scheduler over `runner`'s cache, carrying the runner so `run_step` can execute its plans."""
    scheduler = Scheduler.for_runner(runner, SchedulerLimits(**settings))
    scheduler.runner = runner
    return scheduler


def run(scheduler, requests, max_steps=5000, joins=None):
    """Step until idle; `joins` maps a step number to requests added before that step."""
    outputs = collections.defaultdict(dict)
    finals = {}
    for request in requests:
        scheduler.add(request)
    joins = dict(joins or {})
    for step in range(max_steps):
        for request in joins.pop(step, []):
            scheduler.add(request)
        if not scheduler.has_work() and not joins:
            break
        for request, output in run_step(scheduler, scheduler.runner):
            assert not isinstance(output, BaseException), output
            outputs[id(request)].setdefault(output.index, []).extend(output.token_ids)
            if output.finished:
                finals[(id(request), output.index)] = output
    return outputs, finals


def make(prompt, **options):
    options.setdefault("max_tokens", 12)
    options.setdefault("temperature", 0.0)
    return Request("r", prompt, SamplingOptions(**options))


def assert_idle(scheduler):
    assert not scheduler.has_work() and scheduler.num_running_sequences() == 0
    assert scheduler.kv_blocks_used() == 0


def test_model_info(runner):
    info = runner.info
    assert info.vocab_size == 1013 and info.max_context_length == 2048
    assert info.eos_token_ids == (1002, 1000)
    assert info.dtype == "float32" and info.device == "cpu" and len(info.fingerprint) == 16
    assert runner.cache.num_blocks == 256 and runner.cache.block_size == 16


def test_greedy_equals_hf_generate_alone(runner):
    scheduler = scheduler_over(runner, max_running_sequences=8)
    for prompt in PROMPTS:
        request = make(prompt)
        outputs, finals = run(scheduler, [request])
        expected = hf_greedy(runner, prompt, 12)
        assert outputs[id(request)][0] == expected
        final = finals[(id(request), 0)]
        assert final.usage.prompt_tokens == len(prompt) and final.usage.completion_tokens == len(expected)
    assert_idle(scheduler)
    assert scheduler.finished_requests == 3


def test_greedy_equals_hf_in_a_batch_of_16_joining_at_different_steps(runner):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 60))] for _ in range(16)]
    # A small prefill budget so long prompts are chunked beside running decodes.
    scheduler = scheduler_over(runner, max_running_sequences=16, max_prefill_tokens=24)
    requests = [make(prompt, max_tokens=20 + i, ignore_eos=True) for i, prompt in enumerate(prompts)]
    joins = {3 * i: [request] for i, request in enumerate(requests)}
    outputs, finals = run(scheduler, [], joins=joins)
    for i, (prompt, request) in enumerate(zip(prompts, requests)):
        assert outputs[id(request)][0] == hf_greedy(runner, prompt, 20 + i), i
        assert finals[(id(request), 0)].finish_reason is FinishReason.LENGTH
    assert_idle(scheduler)


def test_max_running_limits_admission(runner):
    scheduler = scheduler_over(runner, max_running_sequences=1)
    a, b = make(PROMPTS[0], max_tokens=3), make(PROMPTS[1], max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler, scheduler.runner)
    assert scheduler.running == [a] and list(scheduler.waiting) == [b]
    run(scheduler, [])
    assert scheduler.finished_requests == 2
    assert_idle(scheduler)


def test_stop_tokens_min_tokens_and_ignore_eos(runner):
    greedy = hf_greedy(runner, PROMPTS[0], 12)
    stop_at = greedy[4]
    scheduler = scheduler_over(runner, max_running_sequences=8)
    stop = make(PROMPTS[0], stop_token_ids=frozenset({stop_at}))
    length = make(PROMPTS[0], max_tokens=5, ignore_eos=True)
    outputs, finals = run(scheduler, [stop, length])
    first_index = greedy.index(stop_at)
    assert outputs[id(stop)][0] == greedy[:first_index + 1]
    assert finals[(id(stop), 0)].finish_reason is FinishReason.STOP
    assert finals[(id(stop), 0)].matched_stop_token_id == stop_at
    assert finals[(id(length), 0)].finish_reason is FinishReason.LENGTH
    assert len(outputs[id(length)][0]) == 5
    # min_tokens bans the stop token until enough tokens exist.
    banned = make(PROMPTS[0], stop_token_ids=frozenset({greedy[0]}), min_tokens=3, max_tokens=6)
    outputs, finals = run(scheduler, [banned])
    assert outputs[id(banned)][0][0] != greedy[0]
    assert len(outputs[id(banned)][0]) >= 3
    assert_idle(scheduler)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(runner):
    def sampled(with_neighbours):
        scheduler = scheduler_over(runner, max_running_sequences=16)
        target = make(PROMPTS[1], temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True)
        others = [make(PROMPTS[0], temperature=1.0, max_tokens=8), make(PROMPTS[2], max_tokens=5)] \
            if with_neighbours else []
        outputs, _ = run(scheduler, others + [target])
        assert_idle(scheduler)
        return outputs[id(target)]

    alone, shared = sampled(False), sampled(True)
    assert alone == shared
    assert alone[0] != alone[1]  # choices of one request differ


def test_n_choices_fork_from_one_prefill_and_share_prompt_blocks(runner):
    scheduler = scheduler_over(runner, max_running_sequences=16)
    prompt = list(range(10, 31))  # 21 tokens: one full block of 16 shared, the partial one copied
    request = make(prompt, n=3, max_tokens=6, ignore_eos=True)
    scheduler.add(request)
    run_step(scheduler, scheduler.runner)  # prefill + fork + first token of every choice
    tables = [seq.block_table for seq in request.sequences]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full block is shared
    assert len({table[1] for table in tables}) == 3  # the partial block is per choice
    assert scheduler.kv_blocks_used() == 4
    outputs, finals = run(scheduler, [])
    expected = hf_greedy(runner, prompt, 6)
    assert [outputs[id(request)][i] for i in range(3)] == [expected[1:]] * 3  # step 1 output was consumed
    assert all(finals[(id(request), i)].usage.completion_tokens == 6 for i in range(3))
    assert_idle(scheduler)


def test_abort_frees_blocks_of_running_and_waiting_requests(runner):
    scheduler = scheduler_over(runner, max_running_sequences=1)
    running, waiting = make(PROMPTS[0], max_tokens=50), make(PROMPTS[1], max_tokens=50)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler, scheduler.runner)
    assert scheduler.kv_blocks_used() == 1
    aborted = scheduler.abort(running)
    assert [out.finish_reason for out in aborted] == [FinishReason.ABORT]
    assert aborted[0].usage.completion_tokens == 1
    assert scheduler.kv_blocks_used() == 0
    assert [out.finish_reason for out in scheduler.abort(waiting)] == [FinishReason.ABORT]
    assert scheduler.abort(running) == []
    assert_idle(scheduler)


def test_preemption_under_a_tiny_cache_keeps_greedy_output_exact(tiny_cache_runner):
    # 4 requests of 6 + 14 tokens need 5 blocks each at the end: 20 > 12, so some are preempted
    # and later recompute prompt + generated tokens; the output must not change.
    runner = tiny_cache_runner
    prompts = [[7 + i, 8, 9, 10, 11, 12] for i in range(4)]
    scheduler = scheduler_over(runner, max_running_sequences=8)
    requests = [make(prompt, max_tokens=14, ignore_eos=True) for prompt in prompts]
    outputs, finals = run(scheduler, requests)
    for prompt, request in zip(prompts, requests):
        assert outputs[id(request)][0] == hf_greedy(runner, prompt, 14)
    assert scheduler.preemptions > 0
    assert sum(request.preemptions for request in requests) == scheduler.preemptions
    assert_idle(scheduler)


def test_preemption_of_a_forked_request_keeps_seeded_output(tiny_cache_runner):
    runner = tiny_cache_runner
    scheduler = scheduler_over(runner, max_running_sequences=8)
    seeded = make([3, 4, 5, 6, 7], n=2, temperature=1.0, seed=5, max_tokens=14, ignore_eos=True)
    greedy = make([9, 9, 8, 7, 6, 5], max_tokens=24, ignore_eos=True)
    outputs, _ = run(scheduler, [greedy, seeded])
    assert seeded.preemptions > 0
    assert outputs[id(greedy)][0] == hf_greedy(runner, [9, 9, 8, 7, 6, 5], 24)
    alone = scheduler_over(runner, max_running_sequences=8)
    again = make([3, 4, 5, 6, 7], n=2, temperature=1.0, seed=5, max_tokens=14, ignore_eos=True)
    reference, _ = run(alone, [again])
    assert outputs[id(seeded)] == reference[id(again)]
    assert_idle(scheduler)


def test_penalties_and_logprobs_through_the_step(runner):
    scheduler = scheduler_over(runner, max_running_sequences=8)
    plain = make(PROMPTS[1], max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    penalised = make(PROMPTS[1], max_tokens=8, ignore_eos=True, repetition_penalty=5.0, frequency_penalty=2.0)
    tokens = collections.defaultdict(list)
    logprobs = []
    scheduler.add(plain)
    scheduler.add(penalised)
    while scheduler.has_work():
        for request, output in run_step(scheduler, scheduler.runner):
            tokens[id(request)].extend(output.token_ids)
            if request is plain:
                logprobs.extend(output.logprobs)
    assert tokens[id(plain)] == hf_greedy(runner, PROMPTS[1], 8)
    assert len(logprobs) == 8 and all(entry.sampled.rank == 1 for entry in logprobs)
    assert all(entry.top[0].token_id == entry.sampled.token_id for entry in logprobs)
    assert all(entry.top[0].logprob >= entry.top[1].logprob for entry in logprobs)
    # A strong penalty forbids repeating: every generated token is new and none is from the prompt.
    generated = tokens[id(penalised)]
    assert len(set(generated)) == len(generated) and not set(generated) & set(PROMPTS[1])
    assert_idle(scheduler)


def test_a_request_that_exactly_fits_the_whole_cache_runs(tiny_cache_runner):
    # 12 blocks of 4 tokens; 45 prompt + 3 new = 48 tokens = every block (no spare left to ask for).
    scheduler = scheduler_over(tiny_cache_runner, max_running_sequences=8)
    prompt = [(7 * i) % 1000 for i in range(45)]
    request = make(prompt, max_tokens=3, ignore_eos=True)
    outputs, _ = run(scheduler, [request], max_steps=50)
    assert outputs[id(request)][0] == hf_greedy(tiny_cache_runner, prompt, 3)
    assert_idle(scheduler)


def test_prefix_cache_reuses_prompt_blocks_and_keeps_output_exact(runner):
    scheduler = scheduler_over(runner, max_running_sequences=8)
    system = [(11 * i) % 997 for i in range(40)]  # a shared "system prompt": 2 full blocks of 16
    first = make(system + [1, 2, 3], max_tokens=6, ignore_eos=True)
    outputs, finals = run(scheduler, [first])
    assert finals[(id(first), 0)].usage.cached_tokens == 0
    assert scheduler.prefix_cache_hit_tokens == 0
    assert_idle(scheduler)  # cached blocks are unreferenced: they count as free

    again = make(system + [1, 2, 3], max_tokens=6, ignore_eos=True)
    other_tail = make(system + [9, 9], max_tokens=6, ignore_eos=True)
    salted = make(system + [1, 2, 3], max_tokens=6, ignore_eos=True)
    salted.cache_salt = "tenant-b"
    outputs, finals = run(scheduler, [again, other_tail, salted])
    assert finals[(id(again), 0)].usage.cached_tokens == 32
    assert finals[(id(other_tail), 0)].usage.cached_tokens == 32
    assert finals[(id(salted), 0)].usage.cached_tokens == 0  # another tenant's salt never hits
    for request in (again, salted):
        assert outputs[id(request)][0] == hf_greedy(runner, system + [1, 2, 3], 6)
    assert outputs[id(other_tail)][0] == hf_greedy(runner, system + [9, 9], 6)
    assert scheduler.prefix_cache_hit_tokens == 64
    assert_idle(scheduler)


def test_prefix_cache_never_covers_the_last_prompt_token(runner):
    scheduler = scheduler_over(runner, max_running_sequences=8)
    prompt = [(5 * i) % 991 for i in range(32)]  # exactly 2 blocks
    run(scheduler, [make(prompt, max_tokens=2)])
    again = make(prompt, max_tokens=4, ignore_eos=True)
    outputs, finals = run(scheduler, [again])
    assert finals[(id(again), 0)].usage.cached_tokens == 16  # the block holding the last token reruns
    assert outputs[id(again)][0] == hf_greedy(runner, prompt, 4)


def test_prefix_cache_under_eviction_pressure(tiny_cache_runner):
    # 12 blocks of 4: many distinct prompts evict each other's cached blocks; repeats still exact.
    scheduler = scheduler_over(tiny_cache_runner, max_running_sequences=8)
    prompts = [[(13 * i + j) % 997 for j in range(10)] for i in range(6)]
    for round_ in range(2):
        requests = [make(prompt, max_tokens=5, ignore_eos=True) for prompt in prompts]
        outputs, _ = run(scheduler, requests)
        for prompt, request in zip(prompts, requests):
            assert outputs[id(request)][0] == hf_greedy(tiny_cache_runner, prompt, 5), round_
        assert_idle(scheduler)
    assert scheduler.kv.allocator.num_cached <= 12


def test_each_finished_request_logs_one_line_with_its_timings(runner, caplog):
    scheduler = scheduler_over(runner, max_running_sequences=8)
    request = make(PROMPTS[1], max_tokens=5, ignore_eos=True)
    with caplog.at_level("INFO", logger="tito_engine.scheduling.scheduler"):
        run(scheduler, [request])
    lines = [record for record in caplog.records if record.getMessage().startswith("finished:")]
    assert len(lines) == 1 and lines[0].request_id == "r"
    message = lines[0].getMessage()
    for field in ("prompt_tokens=6", "completion_tokens=5", "queue=", "ttft=", "tpot=", "finish=length"):
        assert field in message, message
