"""Request migration: a chat whose engine goes away mid-stream continues on another engine.

A token-in/token-out router holds everything needed to continue a choice elsewhere: the prompt's
ids and the ids generated so far. When an engine's Generate stream fails with a status that
means "this engine is gone" (UNAVAILABLE: the connection was lost, the engine is shutting down
or draining, its model process died or is restarting; CANCELLED that the router's caller did not
ask for: the engine's server ended the call as it stopped), the router sends the prompt followed by
the generated ids to another engine, as one choice whose last `prior_output_tokens` ids are
output, with the rest of the budget (max_tokens and min_tokens minus what was generated; stop
ids, EOS handling and everything else unchanged). The caller's stream goes on with the next id:
no gap, no duplicate; derender never notices (stop strings are its own, over one stream). The
last message's usage is reported as the first engine would have: the original prompt, and every
completion token of the choice.

n > 1: each unfinished choice continues as a request of its own (n = 1), one after another, its
messages given back under the choice's index; a seeded request's choice i continues with seed
+ i, the seed the engines give that choice (tito's native engine and vLLM alike). A request that
failed before any token moves whole. Structured output: the continuation carries the same
constraint, and the native engine advances its grammar over the earlier ids before generating
(a vLLM engine refuses such a continuation with FAILED_PRECONDITION, which reaches the caller).

Exactness: greedy choices equal an uninterrupted run. A seeded choice draws the same tokens on a
native engine, which derives each draw from (seed, output position) (tito_engine's sampler); a
vLLM engine restarts its generator from the seed at the continuation. Presence/frequency
penalties count the earlier output on a native engine. Media requests carry the same features
(the generated ids follow the prompt, so every placeholder stays where it was).

Not migrated (the error reaches the caller as before): a caller's mistake (any status but
UNAVAILABLE, and RESOURCE_EXHAUSTED QUEUE_FULL: that engine's queue, not the request), more than
`migration_limit` moves of one request, or no other engine to go to.
"""

from __future__ import annotations

import grpc

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2

#: The reason a draining engine gives (tito_engine.backend.drain): send the request elsewhere.
ENGINE_DRAINING = "ENGINE_DRAINING"
#: An engine's waiting queue is full: a limit of that engine, not of the request.
QUEUE_FULL = "QUEUE_FULL"
#: Seeds are uint64 on the wire; choice i's seed wraps as the engines wrap it.
_SEED_MASK = 2**64 - 1


def engine_gone(error: grpc.RpcError) -> bool:
    """The engine went away or asks the caller to go elsewhere (UNAVAILABLE, or its own queue is
    full, or CANCELLED, which reaches a stream its caller did not cancel only when the engine's
    server ended the call: it shut down with the stream open); never a caller's mistake
    (INVALID_ARGUMENT, a RESOURCE_EXHAUSTED the request itself causes such as KV_CACHE_TOO_SMALL,
    FAILED_PRECONDITION, ...). The streams check their own cancellation first."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_details(error)["reason"] == QUEUE_FULL


def engine_draining(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.UNAVAILABLE and error_details(error)["reason"] == ENGINE_DRAINING


class RequestProgress:
    """What the caller has received of a request, choice by choice, and the calls that continue it."""

    def __init__(self, request: engine_pb2.GenerateRequest):
        self.request = request
        params = request.sampling_params
        self.choices = params.n if params.HasField("n") and params.n > 1 else 1
        self.generated: list[list[int]] = [[] for _ in range(self.choices)]
        self.finished = [False] * self.choices
        self.migrations = 0
        self._serving = list(range(self.choices))  # the choice each index of the current call stands for
        self._continued = False  # the current call continues choices begun elsewhere: usage is rewritten
        self._calls = 0  # continuation calls sent, for their request ids

    @property
    def complete(self) -> bool:
        return all(self.finished)

    def served_finished(self) -> bool:
        """Every choice the current call serves has ended."""
        return all(self.finished[index] for index in self._serving)

    def record(self, response: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Take one engine message; return it as the caller sees it (a continuation's index is its
        choice's, and its usage counts the original prompt and the choice's whole output)."""
        index = self._serving[response.index] if response.index < len(self._serving) else response.index
        response.index = index
        self.generated[index].extend(response.token_ids)
        if response.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished[index] = True
        if self._continued and response.HasField("usage"):
            prompt = len(self.request.token_ids)
            response.usage.prompt_tokens = prompt
            response.usage.completion_tokens = len(self.generated[index])
            response.usage.cached_tokens = min(response.usage.cached_tokens, prompt)
        return response

    def next_call(self) -> tuple[engine_pb2.GenerateRequest | None, list[engine_pb2.GenerateResponse]]:
        """The request that continues the next unfinished choice (None: nothing is left), and the
        last messages of choices that had used their whole budget when their engine died (it sent
        their last token but not why they ended), to give the caller first."""
        closing = []
        if not any(self.generated) and not any(self.finished):
            return self._send(self._copy(), list(range(self.choices))), closing  # nothing yet: move it whole
        for index in range(self.choices):
            if self.finished[index]:
                continue
            budget = self._remaining_budget(index)
            if budget is not None and budget < 1:
                closing.append(self._length_finish(index))
                continue
            return self._send(self._continuation(index), [index]), closing
        return None, closing

    def migrated(self) -> None:
        self.migrations += 1

    def _remaining_budget(self, index: int) -> int | None:
        params = self.request.sampling_params
        return params.max_tokens - len(self.generated[index]) if params.HasField("max_tokens") else None

    def _copy(self) -> engine_pb2.GenerateRequest:
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.ClearField("kv_transfer")  # a KV handle is single-use: the next engine prefills itself
        self._calls += 1
        if request.request_id:  # the engine left may still hold the id for a moment
            request.request_id = f"{self.request.request_id}~{self._calls}"
        return request

    def _continuation(self, index: int) -> engine_pb2.GenerateRequest:
        request = self._copy()
        params = request.sampling_params
        if self.choices > 1:
            params.ClearField("n")
            if params.HasField("seed"):
                params.seed = (params.seed + index) & _SEED_MASK
        done = self.generated[index]
        if done:
            request.token_ids.extend(done)
            if params.HasField("max_tokens"):
                params.max_tokens -= len(done)
            params.min_tokens = max(0, params.min_tokens - len(done))
            params.prior_output_tokens += len(done)
        return request

    def _send(self, request: engine_pb2.GenerateRequest, serving: list[int]) -> engine_pb2.GenerateRequest:
        self._serving = serving
        self._continued = any(self.generated[index] for index in serving) or self.migrations > 0
        return request

    def _length_finish(self, index: int) -> engine_pb2.GenerateResponse:
        self.finished[index] = True
        return engine_pb2.GenerateResponse(
            index=index, finish_reason=engine_pb2.FINISH_REASON_LENGTH,
            usage=engine_pb2.Usage(prompt_tokens=len(self.request.token_ids),
                                   completion_tokens=len(self.generated[index])))
