"""The engine thread and its async facade, without gRPC."""

import asyncio

import pytest

from tito.config import ConfigError
from tito.errors import InvalidArgument
from tito_engine.backend.admission import Admission
from tito_engine.config import EngineConfig
from tito_engine.core.engine import Engine
from tito_engine.limits import SchedulerLimits
from tito_engine.model.runner import ModelRunner
from tito_engine.request import FinishReason, GenerateInput, RawSamplingParams


@pytest.fixture(scope="module")
def runner(tiny_text_model):
    return ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu")


@pytest.fixture
def engine(runner):
    engine = Engine(runner, limits=SchedulerLimits(max_running_sequences=4))
    engine.start()
    yield engine
    engine.stop()


def greedy(prompt, request_id="", **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 6)
    return GenerateInput(request_id, prompt, RawSamplingParams(**sampling))


def admitted(engine, generate_input):
    return Admission.for_backend(engine).admit(generate_input)


async def tokens_of(engine, generate_input):
    tokens, finish = [], None
    async for output in engine.generate(admitted(engine, generate_input)):
        tokens.extend(output.token_ids)
        finish = output.finish_reason
    return tokens, finish


def test_concurrent_async_streams_and_load(engine):
    async def main():
        results = await asyncio.gather(*(tokens_of(engine, greedy([i + 5, 7, 9])) for i in range(6)))
        alone = [await tokens_of(engine, greedy([i + 5, 7, 9])) for i in range(6)]
        return results, alone

    results, alone = asyncio.run(main())
    assert results == alone  # 6 requests with 4 slots: some waited, none was disturbed
    load = engine.load()
    assert (load.running_requests, load.waiting_requests, load.finished_requests) == (0, 0, 12)


def test_closing_the_stream_aborts_and_ids_can_be_reused(engine):
    async def main():
        stream = engine.generate(admitted(engine, greedy([5, 6], request_id="x", max_tokens=1500, ignore_eos=True)))
        await stream.__anext__()
        with pytest.raises(InvalidArgument):
            engine.submit(admitted(engine, greedy([5], request_id="x")), lambda _: None)
        await stream.aclose()
        for _ in range(200):
            if engine.load().running_requests == 0 and engine.abort(["x"]) == []:
                break
            await asyncio.sleep(0.01)
        return await tokens_of(engine, greedy([5, 6], request_id="x"))

    tokens, finish = asyncio.run(main())
    assert len(tokens) == 6 and finish is FinishReason.LENGTH


def test_a_failing_forward_fails_its_batch_and_the_engine_carries_on(engine, runner, monkeypatch):
    real_run = runner.run
    calls = {"n": 0}

    def flaky_run(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device error")
        return real_run(plan)

    monkeypatch.setattr(runner, "run", flaky_run)

    async def main():
        with pytest.raises(RuntimeError, match="simulated"):
            await tokens_of(engine, greedy([5, 6]))
        return await tokens_of(engine, greedy([5, 6]))

    tokens, finish = asyncio.run(main())
    assert len(tokens) == 6 and finish is FinishReason.LENGTH
    load = engine.load()
    assert load.running_requests == 0 and load.kv_blocks_used == 0


@pytest.mark.parametrize("overrides", [{"device": "tpu"}, {"max_running_sequences": 0},
                                       {"max_model_len": 1}, {"max_choices_per_request": 100},
                                       {"max_waiting_requests": -1}])
def test_config_rejects_bad_values(overrides):
    with pytest.raises(ConfigError):
        EngineConfig(**overrides).validate()
    EngineConfig().validate()


def test_an_unexpected_engine_error_fails_live_requests_and_the_engine_recovers(engine, monkeypatch):
    scheduler = engine._core.core.scheduler
    real_schedule = scheduler.schedule
    calls = {"n": 0}

    def broken_schedule():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated scheduler bug")
        return real_schedule()

    monkeypatch.setattr(scheduler, "schedule", broken_schedule)

    async def main():
        with pytest.raises(RuntimeError, match="scheduler bug"):
            await tokens_of(engine, greedy([5, 6], request_id="doomed", max_tokens=20))
        return await tokens_of(engine, greedy([5, 6], request_id="doomed"))

    tokens, finish = asyncio.run(main())
    assert len(tokens) == 6 and finish is FinishReason.LENGTH
    load = engine.load()
    assert load.running_requests == 0 and load.waiting_requests == 0


def test_outputs_that_piled_up_are_merged_per_choice():
    from tito_engine.core.engine import _merge_per_choice
    from tito_engine.request import ChoiceOutput, Usage

    items = [ChoiceOutput(0, (1,)), ChoiceOutput(1, (7,)), ChoiceOutput(0, (2,)),
             ChoiceOutput(0, (3,), FinishReason.LENGTH, usage=Usage(2, 3))]
    merged = _merge_per_choice(items)
    assert [(m.index, m.token_ids, m.finish_reason) for m in merged] == [(0, (1, 2, 3), FinishReason.LENGTH),
                                                                        (1, (7,), None)]
    error = RuntimeError("boom")
    assert _merge_per_choice([ChoiceOutput(0, (1,)), error, ChoiceOutput(0, (2,))])[-1] is error


def test_core_honours_an_abort_that_overtakes_its_add(runner):
    from tito_engine.core.messages import AbortRequest, AddRequest
    from tito_engine.core.engine_core import EngineCore
    from tito_engine.request import SamplingOptions

    core = EngineCore(runner, SchedulerLimits(max_running_sequences=4, max_prefill_tokens=64))
    outputs = []
    core._apply(AbortRequest(9), outputs)
    assert outputs == []
    core._apply(AddRequest(9, "late", [5, 6], SamplingOptions(max_tokens=4, temperature=0.0), None, 0.0, ""),
                outputs)
    assert [(key, out.finish_reason, finished) for key, out, finished in outputs] == [(9, FinishReason.ABORT, True)]
    assert not core.scheduler.has_work() and core.requests == {}


def test_core_refuses_a_command_it_does_not_know(runner):
    from tito_engine.core.engine_core import EngineCore

    core = EngineCore(runner, SchedulerLimits(max_running_sequences=4, max_prefill_tokens=64))
    with pytest.raises(TypeError, match="unknown core command"):
        core._apply(("add", 1), [])


def test_load_reports_kv_blocks(engine, runner):
    load = engine.load()
    assert load.kv_blocks_total == runner.cache.num_blocks and load.kv_block_size == runner.cache.block_size
    assert load.kv_blocks_used == 0


def test_loop_channel_hands_over_once_in_flight_and_drops_for_closed_loops():
    from tito_engine.core.engine import _LoopChannel

    loop = asyncio.new_event_loop()
    got = []
    channel = _LoopChannel(loop)
    channel.send([(got.append, 1)])
    channel.send([(got.append, 2)])  # the first hand-over has not run: these wait and go together
    channel.send([(got.append, 3)])
    assert channel.in_flight and len(channel.pending) == 2
    loop.run_until_complete(asyncio.sleep(0.01))
    assert got == [1, 2, 3] and not channel.in_flight
    loop.close()
    channel.send([(got.append, 4)])
    assert got == [1, 2, 3] and channel.pending == [] and not channel.in_flight
