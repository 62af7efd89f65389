"""vLLM's derender bodies (`/v1/chat/completions/derender`, `/v1/completions/derender`; the
streamed ones' own fields are derender_stream's) -> what derender's stream takes: a context,
then the engine's responses.

Domain code: no HTTP here. vLLM's derender is stateless: the caller sends the generate answer
back with the original request (`chat_request`, `completion_request`). A completion's context
is built here from its text options (no parsers apply); a chat's comes from render, which the
route asks to render `chat_request` again, so its parsers, thinking switch and tools are
exactly those the chat was rendered with."""

from __future__ import annotations

from typing import Any

from tito.v1 import derender_pb2, engine_pb2, render_pb2, sampling_pb2
from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported
from tito_gateway.vllm_api.generate_in import prompt_ids

#: Prompt ids that seed derender's detokenizer (it reads only the last few).
PROMPT_TAIL = 8
FINISH_REASONS = {"stop": engine_pb2.FINISH_REASON_STOP, "length": engine_pb2.FINISH_REASON_LENGTH,
                  "abort": engine_pb2.FINISH_REASON_ABORT}
CHAT_FIELDS = frozenset(("stream", "model", "generate_response", "prompt_tokens", "prompt_token_ids",
                         "chat_request"))
COMPLETION_FIELDS = frozenset(("stream", "model", "generate_responses", "prompt_tokens", "prompt_token_ids",
                               "completion_request"))
RESPONSE_FIELDS = frozenset(("request_id", "model", "created", "usage", "prompt_logprobs",
                             "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
                             "kv_transfer_params", "ec_transfer_params", "output_mode", "choices"))
CHOICE_FIELDS = frozenset(("index", "finish_reason", "stop_reason", "token_ids", "routed_experts",
                           "sampling_mask", "weight_versions", "logprobs"))


def engine_responses(value: Any, where: str, prompt_tokens: int | None) -> list[engine_pb2.GenerateResponse]:
    """A vLLM GenerateTokensResponse -> one finished engine response per choice."""
    if not isinstance(value, dict):
        raise invalid(where, "is required: a generate response object")
    for key in value:
        if key not in RESPONSE_FIELDS:
            raise unsupported(f"{where}.{key[:64]}", "unknown field of vLLM's GenerateResponse")
    if value.get("output_mode", "tokens") != "tokens":
        raise unsupported(f"{where}.output_mode", "only \"tokens\" responses are derendered")
    choices = value.get("choices")
    if not isinstance(choices, list):
        raise invalid(f"{where}.choices", "must be an array of choices")
    prompt = prompt_tokens if prompt_tokens is not None else 0
    return [choice_response(choice, f"{where}.choices[{i}]", prompt_tokens=prompt) for i, choice in enumerate(choices)]


def choice_response(value: Any, where: str, prompt_tokens: int = 0, streamed: bool = False
                    ) -> engine_pb2.GenerateResponse:
    """One vLLM choice -> an engine response. A whole response's choice is final (its usage:
    its tokens); a streamed chunk's is final only with a finish reason, and carries no usage, so
    derender counts the tokens it was sent across calls."""
    if not isinstance(value, dict):
        raise invalid(where, "must be a choice object")
    for key in value:
        if key not in CHOICE_FIELDS:
            raise unsupported(f"{where}.{key[:64]}", "unknown field of vLLM's GenerateTokensChoice")
    tokens = value.get("token_ids") or []
    if tokens:
        prompt_ids(tokens, f"{where}.token_ids")
    reason = openai_in._string(value.get("finish_reason"), f"{where}.finish_reason")
    if reason is None and not streamed:
        reason = "stop"
    if reason is not None and reason not in FINISH_REASONS:
        raise invalid(f"{where}.finish_reason", f"must be one of {', '.join(FINISH_REASONS)}")
    response = engine_pb2.GenerateResponse(
        index=openai_in._integer(value.get("index"), f"{where}.index", 0, openai_in.UINT32_MAX) or 0,
        token_ids=tokens, finish_reason=FINISH_REASONS[reason] if reason else engine_pb2.FINISH_REASON_UNSPECIFIED)
    if not streamed:
        response.usage.CopyFrom(engine_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(tokens)))
    stop = value.get("stop_reason")
    if type(stop) is int and stop >= 0:
        response.matched_stop_token_id = stop
    logprobs = value.get("logprobs")
    if logprobs is not None:
        response.logprobs.extend(_positions(logprobs, f"{where}.logprobs", len(tokens)))
    return response


def _positions(value: Any, where: str, count: int) -> list[engine_pb2.PositionLogprobs]:
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(content, list) or len(content) != count:
        raise invalid(f"{where}.content", "must hold one entry per token id")
    positions = []
    for i, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise invalid(f"{where}.content[{i}]", "must be a logprob object")
        sampled = _token(entry, f"{where}.content[{i}]")
        tops = entry.get("top_logprobs") or []
        others = [_token(top, f"{where}.content[{i}].top_logprobs[{j}]") for j, top in enumerate(tops)]
        # vLLM lists the sampled token first; tito's `top` holds the most likely, by rank.
        if others and others[0].token_id == sampled.token_id:
            others = others[1:]
        positions.append(engine_pb2.PositionLogprobs(sampled=sampled, top=others))
    return positions


def _token(value: Any, where: str) -> engine_pb2.TokenLogprob:
    if not isinstance(value, dict):
        raise invalid(where, "must be a logprob object")
    token = openai_in._integer(value.get("token_id"), f"{where}.token_id", 0, openai_in.UINT32_MAX)
    number = value.get("logprob")
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise invalid(f"{where}.logprob", "must be a number")
    rank = openai_in._integer(value.get("rank"), f"{where}.rank", 0, openai_in.UINT32_MAX) or 0
    return engine_pb2.TokenLogprob(token_id=token or 0, logprob=float(number), rank=rank)


def given_prompt_ids(values: dict[str, Any], response: Any, where: str) -> list[int] | None:
    """The prompt's ids the call carries: `prompt_token_ids`, else the response's (None: neither)."""
    given = values.get("prompt_token_ids")
    if given is None and isinstance(response, dict):
        given, where = response.get("prompt_token_ids"), f"{where}.prompt_token_ids"
    return prompt_ids(given, where) if given else None


def seed_ids(values: dict[str, Any], response: Any, where: str) -> list[int]:
    """The prompt tail that seeds the detokenizer: `prompt_token_ids`, else the response's."""
    return seed_tail(given_prompt_ids(values, response, where))


def seed_tail(prompt_ids: list[int] | None) -> list[int]:
    """The tail of a prompt's ids that seeds the detokenizer (none: no ids)."""
    return (prompt_ids or [])[-PROMPT_TAIL:]


def plain_context(request_id: str, seed: list[int], prompt_tokens: int, n: int, logprobs: bool,
                  text: sampling_pb2.OutputTextOptions | None = None) -> derender_pb2.DerenderContext:
    """A context without parsers: a completion's, or a chat's when no parser is configured."""
    context = derender_pb2.DerenderContext(request_id=request_id, prompt_tail_token_ids=seed,
                                           prompt_tokens=prompt_tokens, n=max(1, n), logprobs=logprobs)
    if text is not None:
        context.text_options.CopyFrom(text)
    return context


def text_options(sampling: render_pb2.SamplingOptions) -> sampling_pb2.OutputTextOptions:
    """The string-level options a completion request asked for, as derender takes them."""
    options = sampling_pb2.OutputTextOptions(stop=list(sampling.stop),
                                             include_stop_str_in_output=sampling.include_stop_str_in_output)
    if sampling.HasField("skip_special_tokens"):
        options.skip_special_tokens = sampling.skip_special_tokens
    if sampling.HasField("spaces_between_special_tokens"):
        options.spaces_between_special_tokens = sampling.spaces_between_special_tokens
    return options
