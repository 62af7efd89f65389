"""Protobuf <-> domain conversion for render (protobuf messages only, no grpc).

Requests become `domain` values (`ChatRequest`, `CompletionRequest`, `TokenizeRequest`) and a
`RenderedPrompt` becomes the response; nothing below the servicer reads or builds a message. The
conversion checks nothing: the domain refuses what it cannot take, naming the request's fields, so
a request is refused alike whatever face it came through.

Each response is built in place: a message passed to a constructor or to extend() is copied, so
a media item's tensors would be copied once more for nothing.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import struct_pb2

from tito.errors import ResourceExhausted
from tito.structured_output import StructuredOutputSpec, spec_from_proto
from tito.v1 import chat_pb2, derender_pb2, engine_pb2, multimodal_pb2, render_pb2, sampling_pb2

from tito_render.domain import (
    ChatMessage, ChatRequest, CompletionRequest, ContentPart, EmptyPart, FunctionCall, FunctionDefinition,
    ImagePart, ImageSource, JsonObject, JsonSchemaFormat, MediaItem, MediaOptions, RenderedPrompt, ResponseFormat,
    SamplingOptions, SamplingParams, TextOptions, TextPart, TokenizeRequest, Tool, ToolCall, ToolChoice, VideoPart)

#: How many trailing prompt ids seed derender's incremental detokenizer.
PROMPT_TAIL_TOKENS = 8


# ------------------------------------------------------------------------------ requests


def _optional(message, name: str):
    """The field's value, None when the request did not set it (proto3 `optional`, a message)."""
    return getattr(message, name) if message.HasField(name) else None


def struct_from_proto(struct: struct_pb2.Struct) -> JsonObject:
    """A Struct as plain values, unchecked (`domain.JsonObject`). Iterative, not recursive: a
    message built in process can nest thousands deep (protobuf's decoder bounds only what arrives
    over the wire), and render's own limit refuses that depth later, naming the field."""
    root: JsonObject = {}
    pending: list[tuple[Any, Any]] = [(struct, root)]
    while pending:
        message, into = pending.pop()
        if isinstance(into, dict):
            for key, value in message.fields.items():
                into[key] = _plain(value, pending)
        else:
            into.extend(_plain(value, pending) for value in message.values)
    return root


def _plain(value: struct_pb2.Value, pending: list[tuple[Any, Any]]) -> Any:
    """One Value as a plain value; a Struct or list comes back empty and is queued to be filled."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        container: Any = {}
        pending.append((value.struct_value, container))
        return container
    if kind == "list_value":
        container = []
        pending.append((value.list_value, container))
        return container
    return None  # null_value, or no kind set


def _optional_struct(message, name: str) -> JsonObject | None:
    return struct_from_proto(getattr(message, name)) if message.HasField(name) else None


def image_source_from_proto(source: chat_pb2.ImageSource) -> ImageSource:
    kind = source.WhichOneof("source")
    if kind == "data":
        return ImageSource(data=source.data)  # each read of a bytes field copies it (upb): read it once
    return ImageSource(url=source.url) if kind == "url" else ImageSource()


def _part_from_proto(part: chat_pb2.ContentPart) -> ContentPart:
    kind = part.WhichOneof("part")
    if kind == "text":
        return TextPart(part.text)
    if kind == "image":
        return ImagePart(image_source_from_proto(part.image))
    if kind == "video":
        return VideoPart(tuple(image_source_from_proto(frame) for frame in part.video.frames), part.video.fps)
    return EmptyPart()


def _tool_call_from_proto(call: chat_pb2.ToolCall) -> ToolCall:
    function = call.function
    kind = function.WhichOneof("args")
    return ToolCall(id=call.id, type=call.type, function=FunctionCall(
        name=function.name, arguments=function.arguments if kind == "arguments" else None,
        arguments_object=struct_from_proto(function.arguments_object) if kind == "arguments_object" else None))


def message_from_proto(message: chat_pb2.ChatMessage) -> ChatMessage:
    return ChatMessage(
        role=message.role, content=_optional(message, "content"),
        content_parts=tuple(_part_from_proto(part) for part in message.content_parts), name=message.name,
        tool_calls=tuple(_tool_call_from_proto(call) for call in message.tool_calls),
        tool_call_id=message.tool_call_id, reasoning_content=_optional(message, "reasoning_content"))


def messages_from_proto(messages) -> tuple[ChatMessage, ...]:
    return tuple(message_from_proto(message) for message in messages)


def tool_from_proto(tool: chat_pb2.Tool) -> Tool:
    function = tool.function
    return Tool(type=tool.type, function=FunctionDefinition(
        name=function.name, description=function.description,
        parameters=_optional_struct(function, "parameters"), strict=_optional(function, "strict")))


def tool_choice_from_proto(choice: chat_pb2.ToolChoice) -> ToolChoice:
    if choice.WhichOneof("choice") == "function_name":
        return ToolChoice(function_name=choice.function_name)
    return ToolChoice(mode=choice.mode)  # an unknown number stays as it is: the domain refuses it


_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "n", "logprobs", "top_logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def sampling_options_from_proto(options: render_pb2.SamplingOptions) -> SamplingOptions:
    return SamplingOptions(
        **{name: _optional(options, name) for name in _OPTIONAL_SAMPLING_FIELDS},
        stop=tuple(options.stop), stop_token_ids=tuple(options.stop_token_ids),
        structured_output=spec_from_proto(options.structured_output)
        if options.HasField("structured_output") else None,
        logit_bias=dict(options.logit_bias))


def media_options_from_proto(options: render_pb2.MediaOptions) -> MediaOptions:
    return MediaOptions(min_pixels=_optional(options, "min_pixels"), max_pixels=_optional(options, "max_pixels"),
                        processor_kwargs=_optional_struct(options, "processor_kwargs"))


def _response_format_from_proto(request: render_pb2.RenderChatRequest) -> ResponseFormat | None:
    if not request.HasField("response_format"):
        return None
    response_format = request.response_format
    json_schema = (JsonSchemaFormat(schema=_optional_struct(response_format.json_schema, "schema"))
                   if response_format.HasField("json_schema") else None)
    return ResponseFormat(type=response_format.type, json_schema=json_schema)


def chat_request_from_proto(request: render_pb2.RenderChatRequest) -> ChatRequest:
    return ChatRequest(
        messages=messages_from_proto(request.messages), request_id=request.request_id,
        tools=tuple(tool_from_proto(tool) for tool in request.tools),
        tool_choice=tool_choice_from_proto(request.tool_choice), chat_template=_optional(request, "chat_template"),
        chat_template_kwargs=_optional_struct(request, "chat_template_kwargs"),
        add_generation_prompt=_optional(request, "add_generation_prompt"),
        continue_final_message=request.continue_final_message,
        sampling=sampling_options_from_proto(request.sampling), mm_payload=request.mm_payload,
        media_options=media_options_from_proto(request.media_options), cache_salt=request.cache_salt,
        return_prompt_text=request.return_prompt_text, response_format=_response_format_from_proto(request),
        parallel_tool_calls=_optional(request, "parallel_tool_calls"),
        usage_in_every_chunk=request.usage_in_every_chunk, lora_name=request.lora_name)


def completion_request_from_proto(request: render_pb2.RenderCompletionRequest) -> CompletionRequest:
    return CompletionRequest(
        prompt=_optional(request, "prompt"), prompt_token_ids=tuple(request.prompt_token_ids),
        request_id=request.request_id, add_special_tokens=_optional(request, "add_special_tokens"),
        sampling=sampling_options_from_proto(request.sampling), cache_salt=request.cache_salt,
        usage_in_every_chunk=request.usage_in_every_chunk, lora_name=request.lora_name)


def tokenize_request_from_proto(request: render_pb2.TokenizeRequest) -> TokenizeRequest:
    return TokenizeRequest(text=request.text, add_special_tokens=request.add_special_tokens,
                           return_token_strings=request.return_token_strings)


# ----------------------------------------------------------------------------- responses


def item_to_proto(item: MediaItem, into: multimodal_pb2.MultiModalItem) -> None:
    into.modality = item.modality
    into.mm_hash = item.mm_hash
    into.placeholder.offset = item.placeholder.offset
    into.placeholder.length = item.placeholder.length
    into.placeholder.is_embed.extend(item.placeholder.is_embed)
    for group, tensors in (("kwargs", item.kwargs), ("metadata", item.metadata)):
        out = getattr(into, group)
        for name, tensor in tensors.items():
            wire = out[name]
            wire.dtype = tensor.dtype
            wire.shape.extend(tensor.shape)
            wire.data = tensor.data
    if item.auth_tag:
        into.auth_key_id = item.auth_key_id
        into.auth_tag = item.auth_tag


def text_options_to_proto(options: TextOptions) -> sampling_pb2.OutputTextOptions:
    return sampling_pb2.OutputTextOptions(
        stop=list(options.stop), include_stop_str_in_output=options.include_stop_str_in_output,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens)


def sampling_to_proto(params: SamplingParams, into: sampling_pb2.SamplingParams) -> None:
    """Every field set (presence included: the engine reads an absent optional as unset), but
    `seed`, `structured_output` and `logit_bias` only when there is one."""
    into.max_tokens = params.max_tokens
    into.min_tokens = params.min_tokens
    into.temperature = params.temperature
    into.top_p = params.top_p
    into.top_k = params.top_k
    into.min_p = params.min_p
    into.presence_penalty = params.presence_penalty
    into.frequency_penalty = params.frequency_penalty
    into.repetition_penalty = params.repetition_penalty
    into.stop_token_ids.extend(params.stop_token_ids)
    into.ignore_eos = params.ignore_eos
    into.n = params.n
    into.logprobs = params.logprobs
    into.top_logprobs = params.top_logprobs
    into.text_options.CopyFrom(text_options_to_proto(params.text_options))
    if params.seed is not None:
        into.seed = params.seed
    if params.structured_output is not None:
        structured_output_to_proto(params.structured_output, into.structured_output)
    into.logit_bias.update(params.logit_bias)


def structured_output_to_proto(spec: StructuredOutputSpec, into: sampling_pb2.StructuredOutput) -> None:
    """`tito.structured_output.spec_from_proto` the other way round."""
    if spec.kind == "json_object":
        into.json_object.SetInParent()
    elif spec.kind == "choice":
        into.choice.choices.extend(json.loads(spec.value))
    else:
        setattr(into, spec.kind, spec.value)


def tool_choice_to_proto(choice: ToolChoice, into: chat_pb2.ToolChoice) -> None:
    if choice.function_name is not None:
        into.function_name = choice.function_name
    else:
        into.mode = choice.mode


def _fill(prompt: RenderedPrompt, generate_request: engine_pb2.GenerateRequest,
          context: derender_pb2.DerenderContext, tools=()) -> None:
    """`tools`: the request's tool definitions, which derender gets exactly as they came."""
    generate_request.request_id = prompt.request_id
    generate_request.token_ids.extend(prompt.token_ids)
    for item in prompt.items:
        item_to_proto(item, generate_request.mm_features.items.add())
    sampling_to_proto(prompt.sampling, generate_request.sampling_params)
    generate_request.cache_salt = prompt.cache_salt
    generate_request.lora_name = prompt.lora_name
    context.request_id = prompt.request_id
    context.prompt_tail_token_ids.extend(prompt.token_ids[-PROMPT_TAIL_TOKENS:])
    context.prompt_tokens = len(prompt.token_ids)
    context.text_options.CopyFrom(text_options_to_proto(prompt.sampling.text_options))
    context.reasoning_parser = prompt.reasoning_parser
    context.tool_parser = prompt.tool_parser
    context.n = prompt.sampling.n
    context.logprobs = prompt.sampling.logprobs
    context.tools.extend(tools)
    if prompt.tool_choice is not None:
        tool_choice_to_proto(prompt.tool_choice, context.tool_choice)
    else:
        context.tool_choice.mode = chat_pb2.TOOL_CHOICE_MODE_NONE  # a raw prompt offers no tools
    context.thinking_enabled = prompt.thinking_enabled
    context.prompt_opens_reasoning = prompt.prompt_opens_reasoning
    context.usage_in_every_chunk = prompt.usage_in_every_chunk


def chat_response_to_proto(prompt: RenderedPrompt, max_bytes: int, tools=()) -> render_pb2.RenderChatResponse:
    """The RenderChat response (`tools`: the request's `chat_pb2.Tool`s, passed through);
    RESOURCE_EXHAUSTED when it would exceed `max_bytes`."""
    response = render_pb2.RenderChatResponse()
    _fill(prompt, response.generate_request, response.derender_context, tools)
    if prompt.prompt_text is not None:
        response.prompt_text = prompt.prompt_text
    check_response_size(response, max_bytes)
    return response


def completion_response_to_proto(prompt: RenderedPrompt) -> render_pb2.RenderCompletionResponse:
    response = render_pb2.RenderCompletionResponse()
    _fill(prompt, response.generate_request, response.derender_context)
    return response


def check_response_size(response, limit: int) -> None:
    size = response.ByteSize()
    if size > limit:
        raise ResourceExhausted(
            f"the response would be {size} bytes, over the limit max_message_bytes={limit} "
            f"(--max-message-bytes): ask for mm_payload METADATA or NONE, fewer or smaller images "
            f"(media_options.max_pixels), or raise the limit", reason="RESPONSE_TOO_LARGE", field="mm_payload",
            metadata={"limit": "max_message_bytes", "max": str(limit), "size": str(size)})


def chat_response(renderer, request: render_pb2.RenderChatRequest, request_id: str = "",
                  time_remaining: float | None = None) -> render_pb2.RenderChatResponse:
    """RenderChat's answer: `renderer.render_chat` (a `tito_render.renderer.Renderer`), as the response."""
    prompt = renderer.render_chat(chat_request_from_proto(request), request_id, time_remaining)
    return chat_response_to_proto(prompt, renderer.limits.max_response_bytes, request.tools)


def completion_response(renderer, request: render_pb2.RenderCompletionRequest,
                        request_id: str = "") -> render_pb2.RenderCompletionResponse:
    """RenderCompletion's answer: `renderer.render_completion`, as the response."""
    return completion_response_to_proto(renderer.render_completion(completion_request_from_proto(request),
                                                                   request_id))


def tokenize_response(renderer, request: render_pb2.TokenizeRequest) -> render_pb2.TokenizeResponse:
    tokens = renderer.tokenize(tokenize_request_from_proto(request))
    response = render_pb2.TokenizeResponse(token_ids=tokens.token_ids)
    if tokens.token_strings is not None:
        response.token_strings.extend(tokens.token_strings)
    return response


def model_info_to_proto(renderer) -> render_pb2.RenderServiceGetModelInfoResponse:
    model = renderer.model
    return render_pb2.RenderServiceGetModelInfoResponse(
        model_id=model.model_id, vocab_size=model.vocab_size, tokenizer_vocab_size=model.tokenizer_vocab_size,
        max_context_length=model.max_context_length, reasoning_parser=model.reasoning_parser,
        tool_parser=model.tool_parser, has_chat_template=model.has_chat_template,
        modalities=[int(modality) for modality in renderer.modalities()])
