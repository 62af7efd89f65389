"""Scheduler policy against a fake runner: no model is loaded.

The fake runner is a "model" whose next token is a function of the whole context, and whose KV
cache holds the token ids themselves: it writes each row's tokens into the slots the row's block
table names and reads the context back through the block table. So a wrong block table, a
missing fork copy or a prefix block registered under the wrong tokens changes the output, and
the expected output is simply `next_token` applied to prompt + generated tokens.
"""

from __future__ import annotations


from tito_engine.request import FinishReason, Request, SamplingOptions
from tito_engine.scheduling.scheduler import run_step

from fake_kv_runner import FakeRunner, drain, expected, request, scheduler_with


def test_outputs_follow_the_context_through_the_block_tables():
    runner = FakeRunner(num_blocks=64, block_size=4)
    scheduler = scheduler_with(runner)
    prompts = [[20 + i] * (3 + 5 * i) for i in range(4)]
    for prompt in prompts:
        scheduler.add(request(prompt))
    tokens = drain(scheduler, runner)
    for prompt in prompts:
        assert tokens[(f"r{prompt[0]}", 0)] == expected(prompt, 6)
    assert scheduler.kv_blocks_used() == 0 and scheduler.finished_requests == 4


def test_admission_is_fifo_within_the_running_limit():
    runner = FakeRunner(num_blocks=64, block_size=4)
    scheduler = scheduler_with(runner, max_running=2)
    first, second, third = request([11, 2]), request([12, 2]), request([13, 2])
    for req in (first, second, third):
        scheduler.add(req)
    run_step(scheduler, runner)
    assert scheduler.running == [first, second] and list(scheduler.waiting) == [third]


def test_long_prompts_are_prefilled_in_chunks_beside_running_decodes():
    runner = FakeRunner(num_blocks=64, block_size=4)
    scheduler = scheduler_with(runner, budget=8)
    short, long = request([30, 1, 2]), request([40] * 20)
    scheduler.add(short)
    run_step(scheduler, runner)
    scheduler.add(long)
    tokens = drain(scheduler, runner)
    # Step 2 onwards: the short request decodes one token per step while the long prompt runs in
    # chunks of at most the budget (8, 8, then 4).
    chunks = [[len(row.token_ids) for row, (req, _) in zip(plan.rows, plan.owners) if req is long]
              for plan in runner.plans[1:4]]
    decodes = [[len(row.token_ids) for row, (req, _) in zip(plan.rows, plan.owners) if req is short]
               for plan in runner.plans[1:4]]
    assert chunks == [[8], [8], [4]] and decodes == [[1], [1], [1]]
    assert tokens[("r40", 0)] == expected([40] * 20, 6)


def test_the_newest_request_is_preempted_and_recomputes_to_the_same_tokens():
    # 10 blocks of 2 tokens: three 6-token prompts generating 6 tokens each cannot all stay.
    runner = FakeRunner(num_blocks=10, block_size=2)
    scheduler = scheduler_with(runner)
    prompts = [[50 + i] * 6 for i in range(3)]
    requests = [request(prompt) for prompt in prompts]
    for req in requests:
        scheduler.add(req)
    tokens = drain(scheduler, runner)
    assert scheduler.preemptions > 0 and requests[-1].preemptions > 0 and requests[0].preemptions == 0
    for prompt in prompts:
        assert tokens[(f"r{prompt[0]}", 0)] == expected(prompt, 6)
    assert scheduler.kv_blocks_used() == 0


def test_choices_fork_from_the_first_prefill_and_share_its_full_blocks():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner)
    prompt = [60] * 10  # two full blocks and a partial one
    scheduler.add(request(prompt, max_tokens=3, n=3))
    first = {output.index: list(output.token_ids) for _, output in run_step(scheduler, runner)}
    plan = runner.plans[0]
    assert len(plan.rows) == 1 and plan.logit_rows == [0, 0, 0]  # one prefill, three choices sample it
    seqs = scheduler.running[0].sequences
    assert seqs[1].block_table[:2] == seqs[0].block_table[:2] == seqs[2].block_table[:2]
    assert len({seq.block_table[2] for seq in seqs}) == 3  # the partial block is copied per choice
    tokens = drain(scheduler, runner)
    assert all(first[i] + tokens[("r60", i)] == expected(prompt, 3) for i in range(3))


def test_a_repeated_prompt_reads_its_full_blocks_from_the_prefix_cache():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner)
    prompt = [70, 3, 5, 7, 9, 11, 13, 15, 17, 19]
    scheduler.add(request(prompt))
    drain(scheduler, runner)
    again = request(prompt)
    scheduler.add(again)
    tokens = drain(scheduler, runner)
    assert again.cached_tokens == 8 and scheduler.prefix_cache_hit_tokens == 8
    assert tokens[("r70", 0)] == expected(prompt, 6)  # the cached blocks hold the right tokens


def test_without_prefix_caching_nothing_is_reused():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner, prefix_caching=False)
    for _ in range(2):
        scheduler.add(request([70] * 10))
        drain(scheduler, runner)
    assert scheduler.prefix_cache_hit_tokens == 0


def test_stop_ids_eos_min_tokens_and_max_tokens_end_choices():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner)
    prompt = [80, 4]
    natural = expected(prompt, 6)
    stops = request(prompt, stop_token_ids=frozenset({natural[2]}))
    delayed = Request("late", prompt, SamplingOptions(max_tokens=6, temperature=0.0, min_tokens=4,
                                                      stop_token_ids=frozenset({natural[2]})))
    for req in (stops, delayed):
        scheduler.add(req)
    tokens = drain(scheduler, runner)
    assert tokens[("r80", 0)] == natural[:3] and stops.sequences[0].finish_reason is FinishReason.STOP
    assert tokens[("late", 0)] == natural and delayed.sequences[0].finish_reason is FinishReason.LENGTH


def test_abort_frees_the_blocks_of_running_and_waiting_requests():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner, max_running=1)
    running, waiting = request([90] * 5), request([91] * 5)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler, runner)
    assert scheduler.kv_blocks_used() == 2
    assert [out.finish_reason for out in scheduler.abort(running)] == [FinishReason.ABORT]
    assert [out.finish_reason for out in scheduler.abort(waiting)] == [FinishReason.ABORT]
    assert scheduler.kv_blocks_used() == 0 and not scheduler.has_work()


def test_a_failed_execution_fails_only_its_batch():
    runner = FakeRunner(num_blocks=32, block_size=4)
    scheduler = scheduler_with(runner, max_running=1)
    doomed, later = request([95, 1]), request([96, 1])
    scheduler.add(doomed)
    scheduler.add(later)
    real_run = runner.run
    runner.run = lambda plan: (_ for _ in ()).throw(RuntimeError("device lost"))
    outputs = run_step(scheduler, runner)
    assert [(req, type(error)) for req, error in outputs] == [(doomed, RuntimeError)]
    runner.run = real_run
    tokens = drain(scheduler, runner)
    assert tokens[("r96", 0)] == expected([96, 1], 6) and scheduler.kv_blocks_used() == 0
