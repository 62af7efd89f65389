"""The scheduler with the tiny text model: greedy output equals HF generate, interleaving is safe."""

import collections

import pytest
import torch

from tito_engine.model_runner import ModelRunner
from tito_engine.request import FinishReason, Request, SamplingOptions
from tito_engine.scheduler import Scheduler

PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 17], [42]]


@pytest.fixture(scope="module")
def runner(tiny_text_model):
    return ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu")


def hf_greedy(runner, prompt, max_new_tokens):
    with torch.inference_mode():
        output = runner.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return output[0, len(prompt):].tolist()


def run(scheduler, requests, max_steps=1000):
    outputs = collections.defaultdict(dict)
    finals = {}
    for request in requests:
        scheduler.add(request)
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        for request, output in scheduler.step():
            assert not isinstance(output, BaseException), output
            outputs[id(request)].setdefault(output.index, []).extend(output.token_ids)
            if output.finished:
                finals[(id(request), output.index)] = output
    return outputs, finals


def make(prompt, **options):
    options.setdefault("max_tokens", 12)
    options.setdefault("temperature", 0.0)
    return Request("r", prompt, SamplingOptions(**options), lambda _: None)


def test_model_info(runner):
    info = runner.info
    assert info.vocab_size == 1013 and info.max_context_length == 2048
    assert info.eos_token_ids == (1002, 1000)
    assert info.dtype == "float32" and info.device == "cpu" and len(info.fingerprint) == 16


def test_greedy_equals_hf_generate_with_requests_interleaved(runner):
    scheduler = Scheduler(runner, max_running_sequences=8)
    requests = [make(prompt) for prompt in PROMPTS]
    outputs, finals = run(scheduler, requests)
    for prompt, request in zip(PROMPTS, requests):
        expected = hf_greedy(runner, prompt, 12)
        assert outputs[id(request)][0] == expected
        final = finals[(id(request), 0)]
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == len(expected)
    assert not scheduler.running and scheduler.finished_requests == 3


def test_a_request_joining_mid_stream_does_not_disturb_others(runner):
    scheduler = Scheduler(runner, max_running_sequences=8)
    first = make(PROMPTS[0], max_tokens=10)
    scheduler.add(first)
    early = [tok for _ in range(3) for _, out in scheduler.step() for tok in out.token_ids]
    second = make(PROMPTS[1], max_tokens=10)
    outputs, _ = run(scheduler, [second])
    assert early + outputs[id(first)][0] == hf_greedy(runner, PROMPTS[0], 10)
    assert outputs[id(second)][0] == hf_greedy(runner, PROMPTS[1], 10)


def test_max_running_limits_admission(runner):
    scheduler = Scheduler(runner, max_running_sequences=1)
    a, b = make(PROMPTS[0], max_tokens=3), make(PROMPTS[1], max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.step()
    assert scheduler.running == [a] and list(scheduler.waiting) == [b]
    outputs, _ = run(scheduler, [])
    assert scheduler.finished_requests == 2


def test_stop_tokens_min_tokens_and_ignore_eos(runner):
    greedy = hf_greedy(runner, PROMPTS[0], 12)
    stop_at = greedy[4]
    scheduler = Scheduler(runner, max_running_sequences=8)
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


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(runner):
    def sampled(with_neighbours):
        scheduler = Scheduler(runner, max_running_sequences=16)
        target = make(PROMPTS[1], temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True)
        others = [make(PROMPTS[0], temperature=1.0, max_tokens=8)] if with_neighbours else []
        outputs, _ = run(scheduler, others + [target])
        return outputs[id(target)]

    alone, shared = sampled(False), sampled(True)
    assert alone == shared
    assert alone[0] != alone[1]  # choices of one request differ


def test_abort_frees_a_running_request(runner):
    scheduler = Scheduler(runner, max_running_sequences=8)
    request = make(PROMPTS[0], max_tokens=50)
    scheduler.add(request)
    scheduler.step()
    aborted = scheduler.abort(request)
    assert [out.finish_reason for out in aborted] == [FinishReason.ABORT]
    assert aborted[0].usage.completion_tokens == 1
    assert not scheduler.has_work() and request.sequences[0].cache is None
    assert scheduler.abort(request) == []
