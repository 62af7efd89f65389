"""Protobuf <-> domain conversion for derender (protobuf messages only, no grpc)."""

from __future__ import annotations

from google.protobuf import json_format

from tito.contract import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tito.errors import InvalidArgument, quoted
from tito.parsers import SCHEMA_READING_TOOL_PARSERS
from tito.v1 import chat_pb2, derender_pb2, engine_pb2
from tito_derender.detokenizer import TextOptions
from tito_derender.domain import (
    Chunk, EngineOutput, EngineUsage, FinishReason, PositionLogprobs, RequestContext, TokenLogprob,
    TokenLogprobText, ToolChoiceMode, Usage)
from tito_derender.full import CompletedChoice

#: The contract's reason for a stop-string list past its bound.
STOP_STRINGS_TOO_LARGE = "STOP_STRINGS_TOO_LARGE"

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
    """OutputTextOptions / DetokenizeRequest flags with the contract's defaults when absent:
    skip_special_tokens true, spaces_between_special_tokens false (text = the tokenizer's decode)."""
    return TextOptions(
        skip_special_tokens=options.skip_special_tokens if options.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(options.spaces_between_special_tokens
                                       if options.HasField("spaces_between_special_tokens") else False))


def tool_choice_from_proto(choice: chat_pb2.ToolChoice, has_tools: bool) -> tuple[ToolChoiceMode, str]:
    """The contract's ToolChoice with UNSPECIFIED resolved (auto with tools, none without)."""
    kind = choice.WhichOneof("choice")
    if kind == "function_name":
        if not choice.function_name:
            raise InvalidArgument("tool_choice.function_name is empty: name one of the tools",
                                  reason="INVALID_TOOL_CHOICE", field="context.tool_choice.function_name")
        return ToolChoiceMode.NAMED, choice.function_name
    mode = choice.mode if kind == "mode" else chat_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode == chat_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        return (ToolChoiceMode.AUTO if has_tools else ToolChoiceMode.NONE), ""
    modes = {chat_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO, chat_pb2.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
             chat_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED}
    if mode not in modes:
        raise InvalidArgument(f"unknown tool_choice mode {mode}", reason="INVALID_TOOL_CHOICE",
                              field="context.tool_choice.mode")
    return modes[mode], ""


def tool_schemas(context: derender_pb2.DerenderContext) -> tuple[tuple[str, dict], ...]:
    """The tools' parameter schemas, converted only for a parser that reads them."""
    if context.tool_parser not in SCHEMA_READING_TOOL_PARSERS:
        return ()
    return tuple((tool.function.name, json_format.MessageToDict(tool.function.parameters))
                 for tool in context.tools if tool.function.HasField("parameters"))


def stop_strings(options) -> tuple[str, ...]:
    """`text_options.stop`, within the contract's bound (tito.contract.MAX_STOP_STRINGS strings of
    at most MAX_STOP_STRING_CHARS characters): every stop string is matched against each piece
    of output, so an unbounded list would cost unbounded time per token."""
    stops = options.stop
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stops)} stop strings: at most {MAX_STOP_STRINGS}",
                              reason=STOP_STRINGS_TOO_LARGE, field="context.text_options.stop",
                              metadata={"limit": "max_stop_strings", "max": str(MAX_STOP_STRINGS)})
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stop string of {len(stop)} characters: at most {MAX_STOP_STRING_CHARS}",
                                  reason=STOP_STRINGS_TOO_LARGE, field=f"context.text_options.stop[{i}]",
                                  metadata={"limit": "max_stop_string_chars", "max": str(MAX_STOP_STRING_CHARS)})
    return tuple(stops)


def context_from_proto(context: derender_pb2.DerenderContext) -> RequestContext:
    tool_names = tuple(tool.function.name for tool in context.tools)
    tool_choice, tool_choice_function = tool_choice_from_proto(context.tool_choice, bool(tool_names))
    if tool_choice == ToolChoiceMode.NAMED and tool_choice_function not in tool_names:
        known = ", ".join(quoted(name) for name in tool_names[:16]) or "none"
        raise InvalidArgument(f"tool_choice.function_name {quoted(tool_choice_function)} is not among the tools "
                              f"(they are: {known})", reason="UNKNOWN_TOOL",
                              field="context.tool_choice.function_name")
    return RequestContext(
        request_id=context.request_id,
        prompt_tail_token_ids=tuple(context.prompt_tail_token_ids),
        prompt_tokens=context.prompt_tokens,
        text=text_options(context.text_options),
        stop=stop_strings(context.text_options),
        include_stop_str_in_output=context.text_options.include_stop_str_in_output,
        reasoning_parser=context.reasoning_parser,
        tool_parser=context.tool_parser,
        tool_names=tool_names,
        tool_schemas=tool_schemas(context),
        tool_choice=tool_choice,
        tool_choice_function=tool_choice_function,
        thinking_enabled=context.thinking_enabled,
        prompt_opens_reasoning=context.prompt_opens_reasoning,
        n=context.n,
        logprobs=context.logprobs,
        usage_in_every_chunk=context.usage_in_every_chunk,
    )


def output_from_proto(response: engine_pb2.GenerateResponse, field: str = "generate_response") -> EngineOutput:
    if response.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED:
        finish = None
    elif response.finish_reason in _FINISH_FROM_PROTO:
        finish = _FINISH_FROM_PROTO[response.finish_reason]
    elif response.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS:
        raise InvalidArgument(
            "finish_reason FINISH_REASON_TOOL_CALLS cannot come from an engine (only STOP, LENGTH or ABORT; "
            "TOOL_CALLS is derender's to set)", reason="INVALID_FINISH_REASON", field=f"{field}.finish_reason")
    else:  # proto3 keeps enum numbers it does not know
        raise InvalidArgument(
            f"finish_reason {response.finish_reason} is not a FinishReason value (an engine sends UNSPECIFIED, "
            f"STOP, LENGTH or ABORT)", reason="INVALID_FINISH_REASON", field=f"{field}.finish_reason")
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
        logprobs=tuple(PositionLogprobs(
            sampled=TokenLogprob(p.sampled.token_id, p.sampled.logprob, p.sampled.rank),
            top=tuple(TokenLogprob(t.token_id, t.logprob, t.rank) for t in p.top)) for p in response.logprobs),
    )


def usage_to_proto(usage: Usage) -> engine_pb2.Usage:
    return engine_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


def logprob_to_proto(entry: TokenLogprobText) -> derender_pb2.TokenLogprobText:
    return derender_pb2.TokenLogprobText(
        token=entry.token, token_id=entry.token_id, logprob=entry.logprob, bytes=entry.bytes,
        top_logprobs=[derender_pb2.TopLogprob(token=top.token, token_id=top.token_id, logprob=top.logprob,
                                              bytes=top.bytes) for top in entry.top_logprobs])


def chunk_to_proto(chunk: Chunk) -> derender_pb2.DerenderResponse:
    return derender_pb2.DerenderResponse(chunk=chat_chunk_to_proto(chunk))


def chat_chunk_to_proto(chunk: Chunk) -> derender_pb2.ChatChunk:
    message = derender_pb2.ChatChunk(
        index=chunk.index, role=chunk.role, content=chunk.content,
        reasoning_content=chunk.reasoning_content,
        tool_calls=[derender_pb2.ToolCallDelta(index=d.index, id=d.id, type=d.type, name=d.name,
                                               arguments=d.arguments) for d in chunk.tool_calls],
        finish_reason=_FINISH_TO_PROTO[chunk.finish_reason], matched_stop=chunk.matched_stop,
        cancel_generation=chunk.cancel_generation,
        logprobs=[logprob_to_proto(entry) for entry in chunk.logprobs])
    if chunk.usage is not None:
        message.usage.CopyFrom(usage_to_proto(chunk.usage))
    return message


def choice_to_proto(choice: CompletedChoice) -> derender_pb2.ChatChoice:
    message = chat_pb2.ChatMessage(role="assistant")
    if choice.content or not choice.tool_calls:  # OpenAI: content null when the answer is only calls
        message.content = choice.content
    if choice.reasoning_content:
        message.reasoning_content = choice.reasoning_content
    message.tool_calls.extend(
        chat_pb2.ToolCall(id=call.id, type="function",
                          function=chat_pb2.FunctionCall(name=call.name, arguments=call.arguments))
        for call in choice.tool_calls)
    return derender_pb2.ChatChoice(index=choice.index, message=message,
                                   finish_reason=_FINISH_TO_PROTO[choice.finish_reason],
                                   matched_stop=choice.matched_stop,
                                   logprobs=[logprob_to_proto(entry) for entry in choice.logprobs])
