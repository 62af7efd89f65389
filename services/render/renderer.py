"""Render requests into what the engine and derender need (blocking; call from a worker thread).

request -> validate -> chat template / tokenize -> resolve sampling -> GenerateRequest +
DerenderContext. Uses protobuf messages (the contract) but no grpc.
"""

from __future__ import annotations

import logging
import uuid

from tito.errors import FieldViolation, InvalidArgument
from tito.v1 import chat_pb2, derender_pb2, engine_pb2, render_pb2

from tito_render.chat_template import (ChatRenderOptions, encode_prompt_text, ends_inside_reasoning,
                                       render_chat_text)
from tito_render.messages import messages_to_dicts, resolve_tool_choice, struct_to_dict, tools_to_dicts
from tito_render.model import THINK_END, THINK_START, RenderModel
from tito_render.sampling import SamplingLimits, resolve_sampling

log = logging.getLogger(__name__)

#: How many trailing prompt ids seed derender's incremental detokenizer.
PROMPT_TAIL_TOKENS = 8


def new_request_id(given: str) -> str:
    return given or uuid.uuid4().hex


class Renderer:
    """Stateless request rendering over one loaded model."""

    def __init__(self, model: RenderModel) -> None:
        self.model = model

    # ------------------------------------------------------------------ chat
    def chat_options(self, request: render_pb2.RenderChatRequest) -> ChatRenderOptions:
        kwargs = struct_to_dict(request.chat_template_kwargs) if request.HasField("chat_template_kwargs") else {}
        if request.continue_final_message:
            if request.HasField("add_generation_prompt") and request.add_generation_prompt:
                raise InvalidArgument("continue_final_message needs add_generation_prompt false (or unset)",
                                      reason="CONFLICTING_OPTIONS", field="continue_final_message")
            add_generation_prompt = False  # the default "true" yields to an explicit continuation
        else:
            add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        return ChatRenderOptions(
            chat_template=request.chat_template if request.HasField("chat_template") else None,
            template_kwargs=kwargs, add_generation_prompt=add_generation_prompt,
            continue_final_message=request.continue_final_message)

    def render_chat(self, request: render_pb2.RenderChatRequest) -> render_pb2.RenderChatResponse:
        messages = messages_to_dicts(list(request.messages))
        if request.continue_final_message and "content" not in messages[-1]:
            raise InvalidArgument("continue_final_message needs a final message with content to continue",
                                  reason="CONFLICTING_OPTIONS", field="continue_final_message")
        tools = tools_to_dicts(list(request.tools))
        tool_choice = resolve_tool_choice(request.tool_choice, list(request.tools))
        options = self.chat_options(request)
        text = render_chat_text(self.model.tokenizer, messages, tools, options)
        token_ids = encode_prompt_text(self.model.tokenizer, text, add_special_tokens=False)
        if not token_ids:
            raise InvalidArgument("the chat template rendered an empty prompt", reason="EMPTY_PROMPT",
                                  field="messages")
        generate_request, context = self._finish(request.request_id, token_ids, request.sampling,
                                                 request.cache_salt, "messages")
        context.tools.extend(request.tools)
        context.tool_choice.CopyFrom(tool_choice)
        enable_thinking = (options.template_kwargs or {}).get("enable_thinking")
        context.thinking_enabled = (enable_thinking if isinstance(enable_thinking, bool)
                                    else bool(self.model.reasoning_parser))
        context.prompt_opens_reasoning = bool(self.model.reasoning_parser) and ends_inside_reasoning(
            text, THINK_START, THINK_END)
        log.info("rendered chat: %d messages, %d tools, %d prompt tokens, max_tokens %d",
                 len(messages), len(request.tools), len(token_ids), generate_request.sampling_params.max_tokens)
        return render_pb2.RenderChatResponse(generate_request=generate_request, derender_context=context,
                                             prompt_text=text if request.return_prompt_text else "")

    # ------------------------------------------------------------ completion
    def render_completion(self, request: render_pb2.RenderCompletionRequest) -> render_pb2.RenderCompletionResponse:
        has_text, has_ids = request.HasField("prompt"), len(request.prompt_token_ids) > 0
        if has_text == has_ids:
            raise InvalidArgument("set exactly one of prompt and prompt_token_ids", reason="INVALID_PROMPT",
                                  field="prompt",
                                  violations=[FieldViolation("prompt_token_ids",
                                                             "set exactly one of prompt and prompt_token_ids")])
        if has_text:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            token_ids = encode_prompt_text(self.model.tokenizer, request.prompt, add_special_tokens=add_special)
            field = "prompt"
            if not token_ids:
                raise InvalidArgument("prompt encodes to no tokens", reason="EMPTY_PROMPT", field="prompt")
        else:
            token_ids = list(request.prompt_token_ids)
            self.check_token_ids(token_ids, "prompt_token_ids")
            field = "prompt_token_ids"
        generate_request, context = self._finish(request.request_id, token_ids, request.sampling,
                                                 request.cache_salt, field)
        context.tool_choice.mode = chat_pb2.TOOL_CHOICE_MODE_NONE  # a raw prompt offers no tools
        return render_pb2.RenderCompletionResponse(generate_request=generate_request, derender_context=context)

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        vocab = self.model.vocab_size
        for i, token_id in enumerate(token_ids):
            if token_id >= vocab:
                raise InvalidArgument(f"token id {token_id} is outside the vocabulary [0, {vocab})",
                                      reason="TOKEN_OUT_OF_RANGE", field=f"{field}[{i}]")

    # ------------------------------------------------------------ shared tail
    def _finish(self, request_id: str, token_ids: list[int], sampling: render_pb2.SamplingOptions,
                cache_salt: str, prompt_field: str) -> tuple[engine_pb2.GenerateRequest, derender_pb2.DerenderContext]:
        request_id = new_request_id(request_id)
        params = resolve_sampling(sampling, SamplingLimits(
            prompt_tokens=len(token_ids), max_context_length=self.model.max_context_length,
            vocab_size=self.model.vocab_size, generation_defaults=self.model.generation_defaults,
            prompt_field=prompt_field))
        generate_request = engine_pb2.GenerateRequest(request_id=request_id, token_ids=token_ids,
                                                      sampling_params=params, cache_salt=cache_salt)
        context = derender_pb2.DerenderContext(
            request_id=request_id, prompt_tail_token_ids=token_ids[-PROMPT_TAIL_TOKENS:],
            prompt_tokens=len(token_ids), text_options=params.text_options,
            reasoning_parser=self.model.reasoning_parser, tool_parser=self.model.tool_parser,
            n=params.n, logprobs=params.logprobs)
        return generate_request, context

    # ------------------------------------------------------------- tokenize
    def tokenize(self, request: render_pb2.TokenizeRequest) -> render_pb2.TokenizeResponse:
        token_ids = encode_prompt_text(self.model.tokenizer, request.text, request.add_special_tokens)
        response = render_pb2.TokenizeResponse(token_ids=token_ids)
        if request.return_token_strings:
            response.token_strings.extend(self.model.tokenizer.convert_ids_to_tokens(token_ids))
        return response

    def model_info(self) -> render_pb2.RenderServiceGetModelInfoResponse:
        return render_pb2.RenderServiceGetModelInfoResponse(
            model_id=self.model.model_id, vocab_size=self.model.vocab_size,
            max_context_length=self.model.max_context_length, reasoning_parser=self.model.reasoning_parser,
            tool_parser=self.model.tool_parser, has_chat_template=self.model.has_chat_template)

