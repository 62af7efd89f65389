"""Request migration: a chat whose engine goes away mid-stream continues on another engine.

A token-in/token-out router holds everything needed to continue a choice elsewhere: the prompt's
ids and the ids generated so far. When an engine's Generate stream fails with a status that
means "this engine is gone" (UNAVAILABLE: the connection was lost, the engine is shutting down
or draining, its model process died or is restarting), the router sends the prompt followed by
the generated ids to another engine, as one choice whose last `prior_output_tokens` ids are
output, with the rest of the budget (max_tokens and min_tokens minus what was generated; stop
ids, EOS handling and everything else unchanged). The caller's stream goes on with the next id:
no gap, no duplicate; derender never notices (stop strings are its own, over one stream). The
last message's usage is reported as the first engine would have: the original prompt, and every
completion token of the choice.

Exactness: greedy choices equal an uninterrupted run. A seeded choice draws the same tokens on a
native engine, which derives each draw from (seed, output position) (tito_engine's sampler); a
vLLM engine restarts its generator from the seed at the continuation. Presence/frequency
penalties count the earlier output on a native engine. Media requests carry the same features
(the generated ids follow the prompt, so every placeholder stays where it was).

Not migrated (the error reaches the caller as before): a caller's mistake (any status but
UNAVAILABLE, and RESOURCE_EXHAUSTED QUEUE_FULL: that engine's queue, not the request), a
request with n > 1 or a structured-output constraint (a grammar's state is not carried), more
than `migration_limit` moves of one request, or no other engine to go to.
"""

from __future__ import annotations

import grpc

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2

#: The reason a draining engine gives (tito_engine.backend.drain): send the request elsewhere.
ENGINE_DRAINING = "ENGINE_DRAINING"
#: An engine's waiting queue is full: a limit of that engine, not of the request.
QUEUE_FULL = "QUEUE_FULL"


def engine_gone(error: grpc.RpcError) -> bool:
    """The engine went away or asks the caller to go elsewhere (UNAVAILABLE, or its own queue is
    full); never a caller's mistake (INVALID_ARGUMENT, a RESOURCE_EXHAUSTED the request itself
    causes such as KV_CACHE_TOO_SMALL, FAILED_PRECONDITION, ...)."""
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_details(error)["reason"] == QUEUE_FULL


def engine_draining(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.UNAVAILABLE and error_details(error)["reason"] == ENGINE_DRAINING


def can_migrate(request: engine_pb2.GenerateRequest) -> bool:
    """One choice and no grammar: what a continuation can reproduce."""
    params = request.sampling_params
    return (not params.HasField("n") or params.n <= 1) and not params.HasField("structured_output")


class ChoiceProgress:
    """What the caller has received of a single-choice request, and how to continue it elsewhere."""

    def __init__(self, request: engine_pb2.GenerateRequest):
        self.request = request
        self.generated: list[int] = []
        self.finished = False
        self.migrations = 0

    def record(self, response: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Take one engine message; return it as the caller sees it (a continuation's usage is
        counted against the original prompt)."""
        self.generated.extend(response.token_ids)
        if response.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True
        if self.migrations and response.HasField("usage"):
            prompt = len(self.request.token_ids)
            response.usage.prompt_tokens = prompt
            response.usage.completion_tokens = len(self.generated)
            response.usage.cached_tokens = min(response.usage.cached_tokens, prompt)
        return response

    def remaining_budget(self) -> int | None:
        """Tokens the choice may still generate (None: up to the context limit)."""
        params = self.request.sampling_params
        return params.max_tokens - len(self.generated) if params.HasField("max_tokens") else None

    def continuation(self) -> engine_pb2.GenerateRequest:
        """The request that continues the choice on another engine (call `migrated()` once sent)."""
        done = len(self.generated)
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.ClearField("kv_transfer")  # a KV handle is single-use: the next engine prefills itself
        if done:
            request.token_ids.extend(self.generated)
            params = request.sampling_params
            if params.HasField("max_tokens"):
                params.max_tokens -= done
            params.min_tokens = max(0, params.min_tokens - done)
            params.prior_output_tokens += done
        if request.request_id:  # the first engine may still hold the id for a moment
            request.request_id = f"{self.request.request_id}~{self.migrations + 1}"
        return request

    def migrated(self) -> None:
        self.migrations += 1

    def length_finish(self) -> engine_pb2.GenerateResponse:
        """The last message of a choice whose engine died after its last token but before saying so."""
        self.finished = True
        return engine_pb2.GenerateResponse(
            index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH,
            usage=engine_pb2.Usage(prompt_tokens=len(self.request.token_ids), completion_tokens=len(self.generated)))
