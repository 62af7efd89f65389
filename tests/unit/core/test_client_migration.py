"""Request migration (tito_client.migration, engine_stream) against fake engines: a chat whose
engine dies mid-stream continues elsewhere with no gap or duplicate and the original usage, only
"engine gone" errors move a chat, the limit holds, and what cannot be continued is not."""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tito.v1 import engine_pb2, sampling_pb2
from tito_client.engine_stream import AsyncMigratingStream, MigratingStream
from tito_client.migration import RequestProgress
from tito_client.routing import Choice, NoEngineAvailable

PROMPT = [5, 9, 2, 7]
STOP = 999


class FakeRpcError(grpc.RpcError):
    """A status as an engine sends it: code, and an ErrorInfo reason when given."""

    def __init__(self, code: grpc.StatusCode, reason: str | None = None):
        super().__init__(code.name)
        self._code = code
        self._trailing = ()
        if reason is not None:
            status = status_pb2.Status(code=code.value[0], message=code.name)
            status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain="tito.dev"))
            self._trailing = rpc_status.to_status(status).trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name

    def trailing_metadata(self):
        return self._trailing


def next_token(ids: list[int], seed: int) -> int:
    """The fake model: a deterministic function of the whole sequence and the choice's seed (as
    a seeded draw is), emitting STOP whenever the running sum says so."""
    total = sum(ids) * 31 + len(ids) + seed * 7
    return STOP if total % 11 == 0 else total % 500


def run_model(request: engine_pb2.GenerateRequest, choice: int = 0):
    """What a fake engine generates for choice `choice` of `request`: (ids, finish reason), as a
    real one decides (choice i draws under seed + i)."""
    ids, params, out = list(request.token_ids), request.sampling_params, []
    seed = params.seed + choice
    budget = params.max_tokens if params.HasField("max_tokens") else 40
    while len(out) < budget:
        token = next_token(ids, seed)
        if token == STOP and len(out) < params.min_tokens:
            token = 1  # min_tokens holds back the stop token
        ids.append(token)
        out.append(token)
        if token == STOP:
            return out, engine_pb2.FINISH_REASON_STOP
    return out, engine_pb2.FINISH_REASON_LENGTH


class FakeEngine:
    """Streams `run_model`'s tokens one message each; fails with `fail_code` after `fail_after` tokens."""

    def __init__(self, fail_after: int | None = None, fail_code=grpc.StatusCode.UNAVAILABLE, reason=None):
        self.fail_after, self.fail_code, self.reason = fail_after, fail_code, reason
        self.requests: list[engine_pb2.GenerateRequest] = []

    def responses(self, request):
        """One message per token, the choices of an n > 1 request interleaved step by step."""
        self.requests.append(request)
        n = request.sampling_params.n or 1
        choices = [run_model(request, choice) for choice in range(n)]
        sent = 0
        for position in range(max(len(out) for out, _ in choices)):
            for index, (out, finish) in enumerate(choices):
                if position >= len(out):
                    continue
                if self.fail_after is not None and sent == self.fail_after:
                    raise FakeRpcError(self.fail_code, self.reason)
                response = engine_pb2.GenerateResponse(index=index, token_ids=[out[position]])
                if position == len(out) - 1:
                    response.finish_reason = finish
                    response.usage.prompt_tokens = len(request.token_ids)
                    response.usage.completion_tokens = len(out)
                    response.usage.cached_tokens = len(request.token_ids)
                sent += 1
                yield response
        if self.fail_after is not None and self.fail_after >= sent:
            raise FakeRpcError(self.fail_code)


class SyncCall:
    def __init__(self, responses):
        self._responses, self.cancelled = responses, False

    def __iter__(self):
        for response in self._responses:
            if self.cancelled:
                raise FakeRpcError(grpc.StatusCode.CANCELLED)
            yield response

    def cancel(self):
        self.cancelled = True


class AsyncCall(SyncCall):
    async def __aiter__(self):
        for response in self._responses:
            await asyncio.sleep(0)
            yield response


class FakeRouter:
    """EngineRouter's side of migration: pick (avoiding the engine left), track, the limit (no adapter loads)."""

    def __init__(self, engines: dict[str, FakeEngine], migration_limit: int = 3):
        self.engines, self.migration_limit = engines, migration_limit
        self.gone: set[str] = set()
        self.in_flight: Counter = Counter()
        self.reserved: list[str] = []

    def reserve(self, address):
        self.reserved.append(address)

    def pick(self, request, avoid=None):
        candidates = [a for a in self.engines if a not in self.gone and a != avoid]
        if not candidates:
            raise NoEngineAvailable("none left")
        return Choice(candidates[0], 0, "fake")

    def adapter_ready(self, address, adapter):  # this router loads no adapters
        pass

    async def adapter_ready_async(self, address, adapter):
        pass

    @contextmanager
    def track(self, address):
        self.in_flight[address] += 1
        try:
            yield
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.gone.add(address)
            raise
        finally:
            self.in_flight[address] -= 1


def request(max_tokens=12, min_tokens=0, n=None, structured=False, request_id="chat-1"):
    params = sampling_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.0, seed=7)
    if n is not None:
        params.n = n
    if structured:
        params.structured_output.regex = "[a-z]+"
    return engine_pb2.GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling_params=params)


def stream(router, original, cls=MigratingStream):
    first = router.pick(original).address
    call = SyncCall if cls is MigratingStream else AsyncCall
    return cls(router, lambda address, req: call(router.engines[address].responses(req)), original, first)


def collect(migrating) -> list[engine_pb2.GenerateResponse]:
    return list(migrating)


def ids_of(responses):
    return [token for response in responses for token in response.token_ids]


def test_a_chat_whose_engine_dies_continues_elsewhere_with_no_gap_duplicate_or_usage_change():
    original = request(max_tokens=12, min_tokens=9)
    solo_ids, solo_finish = run_model(original)
    router = FakeRouter({"a": FakeEngine(fail_after=5), "b": FakeEngine()})
    migrating = stream(router, original)
    responses = collect(migrating)
    assert ids_of(responses) == solo_ids
    assert responses[-1].finish_reason == solo_finish
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), len(solo_ids))
    assert usage.cached_tokens <= len(PROMPT)
    continuation = router.engines["b"].requests[0]
    assert list(continuation.token_ids) == PROMPT + solo_ids[:5]
    params = continuation.sampling_params
    assert (params.max_tokens, params.min_tokens, params.prior_output_tokens) == (7, 4, 5)
    assert params.seed == 7 and continuation.request_id == "chat-1~1"
    assert migrating.address == "b" and router.gone == {"a"} and sum(router.in_flight.values()) == 0
    assert router.reserved == ["a", "b"]  # each engine counted the request before its stream began


def test_the_async_flavour_continues_the_same_way():
    original = request(max_tokens=10, min_tokens=10)

    async def main():
        router = FakeRouter({"a": FakeEngine(fail_after=3), "b": FakeEngine(fail_after=2), "c": FakeEngine()})
        return [response async for response in stream(router, original, AsyncMigratingStream)], router

    responses, router = asyncio.run(main())
    assert ids_of(responses) == run_model(original)[0]
    assert responses[-1].usage.completion_tokens == len(ids_of(responses))
    assert router.engines["c"].requests[0].sampling_params.prior_output_tokens == 5  # 3 on a, 2 on b


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_callers_mistake_or_deadline_is_never_migrated(code):
    router = FakeRouter({"a": FakeEngine(fail_after=2, fail_code=code), "b": FakeEngine()})
    with pytest.raises(grpc.RpcError) as failed:
        collect(stream(router, request()))
    assert failed.value.code() == code
    assert not router.engines["b"].requests


@pytest.mark.parametrize("code, reason, moves", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL", True),  # that engine's queue: another may have room
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "KV_CACHE_TOO_SMALL", False),  # the request itself: nowhere fits it
    (grpc.StatusCode.UNAVAILABLE, "ENGINE_DRAINING", True),
    (grpc.StatusCode.CANCELLED, None, True),  # not asked for by the caller: the engine's server ended it
    (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SAMPLING_PARAMS", False),
])
def test_what_moves_is_decided_by_the_status_and_its_reason(code, reason, moves):
    original = request()
    router = FakeRouter({"a": FakeEngine(fail_after=0, fail_code=code, reason=reason), "b": FakeEngine()})
    if moves:
        assert ids_of(collect(stream(router, original))) == run_model(original)[0]
    else:
        with pytest.raises(grpc.RpcError):
            collect(stream(router, original))
    assert bool(router.engines["b"].requests) == moves


def test_the_migration_limit_bounds_the_moves_of_one_chat():
    engines = {name: FakeEngine(fail_after=1) for name in "abcdef"}
    router = FakeRouter(engines, migration_limit=2)
    with pytest.raises(grpc.RpcError) as failed:
        collect(stream(router, request(min_tokens=12)))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert sum(len(engine.requests) for engine in engines.values()) == 3  # the first try and 2 moves
    none = FakeRouter({"a": FakeEngine(fail_after=1), "b": FakeEngine()}, migration_limit=0)
    with pytest.raises(grpc.RpcError):
        collect(stream(none, request(min_tokens=12)))


def by_choice(responses) -> dict[int, list[int]]:
    choices: dict[int, list[int]] = {}
    for response in responses:
        choices.setdefault(response.index, []).extend(response.token_ids)
    return choices


def solo_choices(original) -> dict[int, list[int]]:
    return {index: run_model(original, index)[0] for index in range(original.sampling_params.n or 1)}


@pytest.mark.parametrize("flavour", [MigratingStream, AsyncMigratingStream])
def test_each_choice_of_an_n_request_continues_on_its_own_under_its_seed(flavour):
    original = request(max_tokens=9, min_tokens=9, n=3)
    router = FakeRouter({"a": FakeEngine(fail_after=7), "b": FakeEngine()})
    if flavour is MigratingStream:
        responses = collect(stream(router, original))
    else:
        async def main():
            return [response async for response in stream(router, original, AsyncMigratingStream)]
        responses = asyncio.run(main())
    assert by_choice(responses) == solo_choices(original)  # no gap, no duplicate, each under its index
    finals = {r.index: r for r in responses if r.finish_reason}
    assert sorted(finals) == [0, 1, 2]
    assert all((r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 9) for r in finals.values())
    continuations = router.engines["b"].requests  # 7 sent on a: 3, 2 and 2 tokens of the three choices
    assert [(c.sampling_params.n, c.sampling_params.seed, c.sampling_params.prior_output_tokens,
             c.sampling_params.max_tokens) for c in continuations] == [(0, 7, 3, 6), (0, 8, 2, 7), (0, 9, 2, 7)]
    assert [c.request_id for c in continuations] == ["chat-1~1", "chat-1~2", "chat-1~3"]
    assert list(continuations[1].token_ids) == PROMPT + solo_choices(original)[1][:2]


def test_a_choice_finished_before_the_move_is_not_continued_and_a_second_move_resumes_the_choice():
    original = request(max_tokens=9, min_tokens=9, n=2)
    original.sampling_params.max_tokens = 2  # choice budgets: both end after 2 tokens ...
    original.sampling_params.min_tokens = 2
    short = run_model(original, 0)[0]
    assert len(short) == 2
    # ... a dies after 3 messages (choice 0 done, choice 1 has 1 token); b dies at once; c finishes.
    router = FakeRouter({"a": FakeEngine(fail_after=3), "b": FakeEngine(fail_after=0), "c": FakeEngine()})
    responses = collect(stream(router, original))
    assert by_choice(responses) == solo_choices(original)
    assert [r.index for r in responses if r.finish_reason] == [0, 1]
    moved = router.engines["b"].requests + router.engines["c"].requests
    assert [(c.sampling_params.seed, c.sampling_params.prior_output_tokens) for c in moved] == [(8, 1), (8, 1)]


def test_an_n_request_that_fails_before_its_first_token_moves_whole():
    original = request(max_tokens=5, min_tokens=5, n=2)
    router = FakeRouter({"a": FakeEngine(fail_after=0), "b": FakeEngine()})
    assert by_choice(collect(stream(router, original))) == solo_choices(original)
    (moved,) = router.engines["b"].requests
    assert moved.sampling_params.n == 2 and list(moved.token_ids) == PROMPT and moved.sampling_params.seed == 7


def test_a_structured_output_chat_continues_with_its_constraint():
    """The engine advances the grammar over the earlier ids (tito_engine's constraints.new_matcher)."""
    original = request(max_tokens=8, min_tokens=8, structured=True)
    router = FakeRouter({"a": FakeEngine(fail_after=3), "b": FakeEngine()})
    assert ids_of(collect(stream(router, original))) == run_model(original)[0]
    (continuation,) = router.engines["b"].requests
    assert continuation.sampling_params.structured_output == original.sampling_params.structured_output
    assert continuation.sampling_params.prior_output_tokens == 3


def test_no_engine_left_gives_the_callers_stream_the_engines_error():
    router = FakeRouter({"a": FakeEngine(fail_after=2)})
    with pytest.raises(grpc.RpcError) as failed:
        collect(stream(router, request()))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


class SilentEnd(FakeEngine):
    """Sends every token but dies before its last message says why the choice ended."""

    def responses(self, request):
        for response in super().responses(request):
            if response.finish_reason:
                response.ClearField("finish_reason")
                response.ClearField("usage")
                yield response
                raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
            yield response


def test_an_engine_that_dies_after_the_last_token_ends_the_choice_without_another_engine():
    original = request(max_tokens=6, min_tokens=6)
    ids, finish = run_model(original)
    assert finish == engine_pb2.FINISH_REASON_LENGTH
    router = FakeRouter({"a": SilentEnd(), "b": FakeEngine()})
    responses = collect(stream(router, original))
    assert ids_of(responses) == ids and responses[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 6
    assert not router.engines["b"].requests


def test_an_error_after_the_choice_finished_ends_the_stream_quietly():
    original = request(max_tokens=6, min_tokens=6)
    router = FakeRouter({"a": FakeEngine(fail_after=6), "b": FakeEngine()})
    responses = collect(stream(router, original))
    assert ids_of(responses) == run_model(original)[0] and not router.engines["b"].requests


def test_a_refusal_before_the_first_token_moves_the_request_whole():
    original = request()
    router = FakeRouter({"a": FakeEngine(fail_after=0), "b": FakeEngine()})
    responses = collect(stream(router, original))
    assert ids_of(responses) == run_model(original)[0]
    moved = router.engines["b"].requests[0]
    assert list(moved.token_ids) == PROMPT and moved.sampling_params.prior_output_tokens == 0
    assert not responses[-1].usage.cached_tokens > len(PROMPT)


def test_a_cancelled_stream_is_not_migrated():
    router = FakeRouter({"a": FakeEngine(fail_after=8), "b": FakeEngine()})
    migrating = stream(router, request(max_tokens=20))
    taken = []
    with pytest.raises(grpc.RpcError) as ended:  # as a cancelled gRPC call ends
        for response in migrating:
            taken.append(response)
            if len(taken) == 2:
                migrating.cancel()
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert len(taken) == 2 and not router.engines["b"].requests


def test_a_media_chat_continues_with_the_same_features():
    original = request(max_tokens=8, min_tokens=8)
    item = original.mm_features.items.add(mm_hash="img-1")
    item.placeholder.offset, item.placeholder.length = 1, 2
    router = FakeRouter({"a": FakeEngine(fail_after=3), "b": FakeEngine()})
    assert ids_of(collect(stream(router, original))) == run_model(original)[0]
    continuation = router.engines["b"].requests[0]
    assert continuation.mm_features == original.mm_features  # placeholders stay where they were


def test_progress_rewrites_usage_only_after_a_move():
    progress = RequestProgress(request())
    first = engine_pb2.GenerateResponse(token_ids=[1, 2], usage=engine_pb2.Usage(prompt_tokens=4,
                                                                               completion_tokens=2))
    assert progress.record(first).usage.prompt_tokens == 4
    progress.migrated()
    progress.next_call()
    last = engine_pb2.GenerateResponse(token_ids=[3], finish_reason=engine_pb2.FINISH_REASON_STOP,
                                       usage=engine_pb2.Usage(prompt_tokens=6, completion_tokens=1,
                                                              cached_tokens=6))
    usage = progress.record(last).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (4, 3, 4)
