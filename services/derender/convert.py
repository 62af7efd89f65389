"""Protobuf <-> domain conversion for derender (protobuf messages only, no grpc)."""

from __future__ import annotations

from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, derender_pb2, engine_pb2
from tito_derender.detokenizer import TextOptions
from tito_derender.domain import (
    Chunk, EngineOutput, EngineUsage, FinishReason, RequestContext, Usage)
from tito_derender.full import CompletedChoice

_FINISH_FROM_PROTO = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_FINISH_TO_PROTO = {
    None: engine_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
    FinishReason.TOOL_CALLS: engine_pb2.FINISH_REASON_TOOL_CALLS,
}


def text_options(options) -> TextOptions:
    """OutputTextOptions / DetokenizeRequest flags with the contract's defaults (true when absent)."""
    return TextOptions(
        skip_special_tokens=options.skip_special_tokens if options.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(options.spaces_between_special_tokens
                                       if options.HasField("spaces_between_special_tokens") else True))


def context_from_proto(context: derender_pb2.DerenderContext) -> RequestContext:
    return RequestContext(
        request_id=context.request_id,
        prompt_tail_token_ids=tuple(context.prompt_tail_token_ids),
        prompt_tokens=context.prompt_tokens,
        text=text_options(context.text_options),
        stop=tuple(context.text_options.stop),
        include_stop_str_in_output=context.text_options.include_stop_str_in_output,
        reasoning_parser=context.reasoning_parser,
        tool_parser=context.tool_parser,
        thinking_enabled=context.thinking_enabled,
        prompt_opens_reasoning=context.prompt_opens_reasoning,
        n=context.n,
        logprobs=context.logprobs,
    )


def _finish_name(value: int) -> str:
    try:
        return engine_pb2.FinishReason.Name(value)
    except ValueError:
        return str(value)


def output_from_proto(response: engine_pb2.GenerateResponse, field: str = "generate_response") -> EngineOutput:
    if response.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED:
        finish = None
    elif response.finish_reason in _FINISH_FROM_PROTO:
        finish = _FINISH_FROM_PROTO[response.finish_reason]
    else:
        raise InvalidArgument(
            f"finish_reason {_finish_name(response.finish_reason)} cannot come from an engine "
            f"(only STOP, LENGTH or ABORT; TOOL_CALLS is derender's to set)",
            reason="INVALID_FINISH_REASON", field=f"{field}.finish_reason")
    usage = None
    if response.HasField("usage"):
        usage = EngineUsage(prompt_tokens=response.usage.prompt_tokens,
                            completion_tokens=response.usage.completion_tokens,
                            cached_tokens=response.usage.cached_tokens)
    return EngineOutput(
        index=response.index,
        token_ids=tuple(response.token_ids),
        finish_reason=finish,
        matched_stop_token_id=(response.matched_stop_token_id
                               if response.HasField("matched_stop_token_id") else None),
        usage=usage,
    )


def usage_to_proto(usage: Usage) -> engine_pb2.Usage:
    return engine_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


def chunk_to_proto(chunk: Chunk) -> derender_pb2.DerenderResponse:
    message = derender_pb2.ChatChunk(
        index=chunk.index, role=chunk.role, content=chunk.content,
        reasoning_content=chunk.reasoning_content,
        finish_reason=_FINISH_TO_PROTO[chunk.finish_reason], matched_stop=chunk.matched_stop,
        cancel_generation=chunk.cancel_generation)
    if chunk.usage is not None:
        message.usage.CopyFrom(usage_to_proto(chunk.usage))
    return derender_pb2.DerenderResponse(chunk=message)


def choice_to_proto(choice: CompletedChoice) -> derender_pb2.ChatChoice:
    message = chat_pb2.ChatMessage(role="assistant", content=choice.content)
    if choice.reasoning_content:
        message.reasoning_content = choice.reasoning_content
    return derender_pb2.ChatChoice(index=choice.index, message=message,
                                   finish_reason=_FINISH_TO_PROTO[choice.finish_reason],
                                   matched_stop=choice.matched_stop)
