"""Domain -> protobuf for render's responses (protobuf messages only, no grpc).

Each response is built in place: a message passed to a constructor or to extend() is copied, so
a media item's tensors would be copied once more for nothing.
"""

from __future__ import annotations

from tito.errors import ResourceExhausted
from tito.v1 import chat_pb2, derender_pb2, engine_pb2, multimodal_pb2, render_pb2, sampling_pb2

from tito_render.domain import MediaItem, RenderedPrompt, SamplingParams, TextOptions

#: How many trailing prompt ids seed derender's incremental detokenizer.
PROMPT_TAIL_TOKENS = 8


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
        into.structured_output.CopyFrom(params.structured_output)
    into.logit_bias.update(params.logit_bias)


def _fill(prompt: RenderedPrompt, generate_request: engine_pb2.GenerateRequest,
          context: derender_pb2.DerenderContext) -> None:
    generate_request.request_id = prompt.request_id
    generate_request.token_ids.extend(prompt.token_ids)
    for item in prompt.items:
        item_to_proto(item, generate_request.mm_features.items.add())
    sampling_to_proto(prompt.sampling, generate_request.sampling_params)
    generate_request.cache_salt = prompt.cache_salt
    context.request_id = prompt.request_id
    context.prompt_tail_token_ids.extend(prompt.token_ids[-PROMPT_TAIL_TOKENS:])
    context.prompt_tokens = len(prompt.token_ids)
    context.text_options.CopyFrom(text_options_to_proto(prompt.sampling.text_options))
    context.reasoning_parser = prompt.reasoning_parser
    context.tool_parser = prompt.tool_parser
    context.n = prompt.sampling.n
    context.logprobs = prompt.sampling.logprobs
    context.tools.extend(prompt.tools)
    if prompt.tool_choice is not None:
        context.tool_choice.CopyFrom(prompt.tool_choice)
    else:
        context.tool_choice.mode = chat_pb2.TOOL_CHOICE_MODE_NONE  # a raw prompt offers no tools
    context.thinking_enabled = prompt.thinking_enabled
    context.prompt_opens_reasoning = prompt.prompt_opens_reasoning
    context.usage_in_every_chunk = prompt.usage_in_every_chunk


def chat_response_to_proto(prompt: RenderedPrompt, max_bytes: int) -> render_pb2.RenderChatResponse:
    """The RenderChat response; RESOURCE_EXHAUSTED when it would exceed `max_bytes`."""
    response = render_pb2.RenderChatResponse()
    _fill(prompt, response.generate_request, response.derender_context)
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
    return chat_response_to_proto(renderer.render_chat(request, request_id, time_remaining),
                                  renderer.limits.max_response_bytes)


def completion_response(renderer, request: render_pb2.RenderCompletionRequest,
                        request_id: str = "") -> render_pb2.RenderCompletionResponse:
    """RenderCompletion's answer: `renderer.render_completion`, as the response."""
    return completion_response_to_proto(renderer.render_completion(request, request_id))


def tokenize_response(renderer, request: render_pb2.TokenizeRequest) -> render_pb2.TokenizeResponse:
    tokens = renderer.tokenize(request)
    response = render_pb2.TokenizeResponse(token_ids=tokens.token_ids)
    if tokens.token_strings is not None:
        response.token_strings.extend(tokens.token_strings)
    return response


def model_info_to_proto(renderer) -> render_pb2.RenderServiceGetModelInfoResponse:
    model = renderer.model
    return render_pb2.RenderServiceGetModelInfoResponse(
        model_id=model.model_id, vocab_size=model.vocab_size, tokenizer_vocab_size=model.tokenizer_vocab_size,
        max_context_length=model.max_context_length, reasoning_parser=model.reasoning_parser,
        tool_parser=model.tool_parser, has_chat_template=model.has_chat_template, modalities=renderer.modalities())
