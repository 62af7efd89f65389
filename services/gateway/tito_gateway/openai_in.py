"""OpenAI request bodies -> render's requests (RenderChatRequest, RenderCompletionRequest).

Domain code: no HTTP here. Every parameter is either mapped or refused: a parameter the gateway
does not know or does not support is INVALID_ARGUMENT `UNSUPPORTED_PARAMETER` naming it, never
silently dropped. A JSON `null` means "not given" (as OpenAI treats it). Ranges that render checks
itself (temperature, top_p, penalties, ...) are left to render, so the gateway and a gRPC caller
are refused alike; the gateway checks only what the protobuf types cannot carry (types, signs).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Container
from typing import Any

from google.protobuf import struct_pb2

from tito.errors import InvalidArgument, NotFound
from tito.v1 import chat_pb2, render_pb2
from tito_gateway import request_json

UNSUPPORTED_PARAMETER = "UNSUPPORTED_PARAMETER"
INVALID_JSON = request_json.INVALID_JSON
MODEL_NOT_FOUND = "MODEL_NOT_FOUND"

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1

#: OpenAI parameters the gateway knows and refuses (with a reason in the message).
REFUSED = {
    "functions": "use `tools`",
    "function_call": "use `tool_choice`",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "set the template's thinking switch with chat_template_kwargs",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported (use n)",
}

#: Values of refused parameters that ask for nothing (OpenAI's defaults), accepted like null.
NO_OPS = {"best_of": 1, "suffix": "", "parallel_tool_calls": True}

SAMPLING_COMMON = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias")
#: OpenAI parameters about the caller's account, not the answer: type-checked, then not used.
UNUSED = ("user", "metadata", "service_tier", "store")
#: OpenAI's service tiers (vLLM takes the same values and ignores them too).
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
COMMON = ("model", "stream", "stream_options", "cache_salt", *UNUSED, *SAMPLING_COMMON)
CHAT_PARAMETERS = frozenset((*COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                             "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs",
                             "chat_template", "add_generation_prompt", "continue_final_message"))
COMPLETION_PARAMETERS = frozenset((*COMMON, "prompt", "logprobs", "add_special_tokens", "echo"))
#: Most prompts one completion request may hold (vLLM's default VLLM_MAX_COMPLETION_PROMPTS).
MAX_COMPLETION_PROMPTS = 1024


def unsupported(param: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{param}: {why}", reason=UNSUPPORTED_PARAMETER, field=param)


def invalid(param: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{param}: {why}", reason="INVALID_REQUEST", field=param)


def parse_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (INVALID_JSON otherwise; NaN and Infinity are not JSON),
    holding only what protobuf can carry (request_json: nesting, lone surrogates, huge numbers)."""
    parsed = request_json.loads(body)
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {_kind(parsed)}", reason=INVALID_JSON)
    return parsed


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class StreamOptions:
    stream: bool
    include_usage: bool
    #: vLLM's continuous_usage_stats: each chunk's own usage too (only with include_usage, as in vLLM)
    continuous_usage: bool = False


#: The role of a chat's answer (vLLM's --response-role default).
RESPONSE_ROLE = "assistant"


@dataclass(frozen=True)
class ChatCall:
    """A chat completion request, parsed: what render gets and how to answer."""

    model: str
    request: render_pb2.RenderChatRequest
    stream: StreamOptions
    logprobs: bool
    #: the answer's role (answer_role)
    role: str = RESPONSE_ROLE

    def set_request_id(self, request_id: str) -> None:
        self.request.request_id = request_id


@dataclass(frozen=True)
class CompletionCall:
    """A completion request, parsed: one render request per prompt, in the body's order."""

    model: str
    requests: tuple[render_pb2.RenderCompletionRequest, ...]
    stream: StreamOptions
    logprobs: int | None  # the legacy API's top-k count; None: no logprobs
    echo: bool = False  # each choice's text starts with its prompt's text

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return max(1, self.requests[0].sampling.n)

    def set_request_id(self, request_id: str) -> None:
        """The request's id; with several prompts, prompt i's is `<id>-<i>` (as vLLM names them),
        so each engine request has its own."""
        if len(self.requests) == 1:
            self.requests[0].request_id = request_id
            return
        for index, request in enumerate(self.requests):
            request.request_id = f"{request_id}-{index}"


class Body:
    """Typed access to a request's parameters; `null` counts as absent."""

    def __init__(self, values: dict[str, Any], allowed: frozenset[str]):
        for name in values:
            if name in allowed:
                continue
            value = values[name]
            if value is None or (name in NO_OPS and type(value) is type(NO_OPS[name]) and value == NO_OPS[name]):
                if name in REFUSED:
                    continue  # an explicit null or default of a refused parameter asks for nothing
            if name in REFUSED:
                raise unsupported(name, REFUSED[name])
            raise unsupported(name, "unknown parameter")
        self.values = values

    def get(self, name: str) -> Any:
        return self.values.get(name)

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

    def string(self, name: str, required: bool = False) -> str | None:
        return _string(self.get(name), name, required)

    def boolean(self, name: str) -> bool | None:
        return _boolean(self.get(name), name)

    def integer(self, name: str, low: int, high: int) -> int | None:
        return _integer(self.get(name), name, low, high)

    def number(self, name: str) -> float | None:
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(name, f"must be a number, not {_kind(value)}")
        return float(value)

    def obj(self, name: str) -> dict | None:
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid(name, f"must be an object, not {_kind(value)}")
        return value


def _string(value: Any, name: str, required: bool = False) -> str | None:
    if value is None:
        if required:
            raise invalid(name, "is required")
        return None
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, not {_kind(value)}")
    return value


def _boolean(value: Any, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, not {_kind(value)}")
    return value


def _integer(value: Any, name: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise invalid(name, f"must be an integer, not {_kind(value)}")
    if not low <= value <= high:
        raise invalid(name, f"must be between {low} and {high}, not {value}")
    return value


def _struct(value: dict, name: str) -> struct_pb2.Struct:
    request_json.check_struct_depth(value, name)  # before Struct.update recurses into it
    struct = struct_pb2.Struct()
    try:
        struct.update(value)
    except (ValueError, TypeError) as exc:
        raise invalid(name, f"is not a JSON object protobuf can carry: {exc}") from None
    return struct


def _schema(value: Any, name: str) -> struct_pb2.Struct | None:
    """An optional JSON Schema (a tool's parameters, a response format's schema) as a Struct."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(name, "must be a JSON Schema object")
    return _struct(value, name)


def check_model(body: Body, served: str, adapters: Container[str] = ()) -> str:
    """The request's `model`: the served model, or a LoRA adapter of it that an engine holds."""
    model = body.string("model", required=True)
    if model != served and model not in adapters:
        # OpenAI's answer, word for word (its param is null); errors.py spells the code
        raise NotFound(f"The model `{model[:256]}` does not exist or you do not have access to it.",
                       reason=MODEL_NOT_FOUND)
    return model


def _adapter(model: str, served: str) -> str:
    """The lora_name render passes to the engine: the model when it is an adapter, else empty."""
    return "" if model == served else model


def _stream_options(body: Body) -> StreamOptions:
    stream = bool(body.boolean("stream"))
    options = body.obj("stream_options")
    if options is None:
        return StreamOptions(stream, False)
    if not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unsupported(f"stream_options.{key}", "unknown stream option")
    include_usage = bool(_boolean(options.get("include_usage"), "stream_options.include_usage"))
    continuous = bool(_boolean(options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats"))
    return StreamOptions(stream, include_usage, include_usage and continuous)


def _sampling(body: Body, max_tokens_name: str = "max_tokens") -> render_pb2.SamplingOptions:
    sampling = render_pb2.SamplingOptions()
    max_tokens = body.integer(max_tokens_name, 1, UINT32_MAX)
    legacy = body.integer("max_tokens", 1, UINT32_MAX)  # checked even where the new name wins
    if max_tokens is None:
        max_tokens = legacy
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.number(name)
        if value is not None:
            setattr(sampling, name, value)
    for name, low, high in (("top_k", -1, INT32_MAX), ("n", 1, UINT32_MAX), ("seed", 0, UINT64_MAX),
                            ("min_tokens", 0, UINT32_MAX)):
        value = body.integer(name, low, high)
        if value is not None:
            setattr(sampling, name, value)
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
        value = body.boolean(name)
        if value is not None:
            setattr(sampling, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list):
        sampling.stop.extend(_string(item, f"stop[{i}]", required=True) for i, item in enumerate(stop))
    elif stop is not None:
        raise invalid("stop", f"must be a string or an array of strings, not {_kind(stop)}")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise invalid("stop_token_ids", f"must be an array of token ids, not {_kind(ids)}")
        sampling.stop_token_ids.extend(_integer(item, f"stop_token_ids[{i}]", 0, UINT32_MAX)
                                       for i, item in enumerate(ids))
    bias = body.obj("logit_bias")
    if bias:
        sampling.logit_bias.update(_logit_bias(bias))
    return sampling


def _logit_bias(value: dict) -> dict[int, float]:
    """OpenAI's logit_bias as token id -> bias. JSON keys are strings ({"50256": -100}); render
    checks the ids against the vocabulary and the biases' range."""
    bias = {}
    for key, number in value.items():
        # At most 10 digits: int() of a very long digit string raises, and no uint32 has more.
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= UINT32_MAX):
            raise invalid("logit_bias", f"key {key[:32]!r} is not a token id (a non-negative integer)")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise invalid(f"logit_bias[{int(key)}]", f"must be a number, not {_kind(number)}")
        try:
            bias[int(key)] = float(number)
        except OverflowError:  # a JSON integer past float's range: render refuses it as out of range
            bias[int(key)] = float("inf") if number > 0 else float("-inf")
    return bias


def _common(body: Body, request) -> None:
    salt = body.string("cache_salt")
    if salt:
        request.cache_salt = salt
    _check_unused(body)


def _check_unused(body: Body) -> None:
    """`user` (an end-user id for OpenAI's abuse tracking), `metadata` (tags for OpenAI's
    dashboard), `service_tier` (OpenAI's billing tier) and `store` (keep the completion on OpenAI's
    side): none of them changes the answer, and tito keeps nothing, so they are accepted and not
    used (as vLLM does) once they have OpenAI's types."""
    body.string("user")
    body.boolean("store")
    tier = body.string("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid("service_tier", f"must be one of {', '.join(SERVICE_TIERS)}, not {tier[:64]!r}")
    metadata = body.obj("metadata")
    for key, value in (metadata or {}).items():
        _string(value, f"metadata.{key[:64]}", required=True)


# -- chat ---------------------------------------------------------------------------------------

MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning",
                            "reasoning_content"))
#: Fields of an assistant message as the SDK echoes a response back; only null is accepted.
MESSAGE_NULL_FIELDS = frozenset(("refusal", "audio", "annotations", "function_call"))


def parse_chat(values: dict[str, Any], served_model: str, adapters: Container[str] = ()) -> ChatCall:
    """`adapters`: the LoRA adapters `model` may also name (then the engine generates with it)."""
    body = Body(values, CHAT_PARAMETERS)
    model = check_model(body, served_model, adapters)
    stream = _stream_options(body)
    request = render_pb2.RenderChatRequest(lora_name=_adapter(model, served_model))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages", "is required: an array of messages" if messages is None
                      else f"must be an array of messages, not {_kind(messages)}")
    request.messages.extend(_message(item, f"messages[{i}]") for i, item in enumerate(messages))
    sampling = _sampling(body, "max_completion_tokens")
    logprobs = bool(body.boolean("logprobs"))
    top = body.integer("top_logprobs", 0, UINT32_MAX)
    if top is not None:
        if not logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        sampling.top_logprobs = top
    if logprobs:
        sampling.logprobs = True
    request.sampling.CopyFrom(sampling)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", f"must be an array of tools, not {_kind(tools)}")
        request.tools.extend(_tool(item, f"tools[{i}]") for i, item in enumerate(tools))
    if body.has("tool_choice"):
        request.tool_choice.CopyFrom(_tool_choice(body.get("tool_choice")))
    parallel = body.boolean("parallel_tool_calls")
    if parallel is not None:
        request.parallel_tool_calls = parallel
    response_format = body.obj("response_format")
    if response_format is not None:
        request.response_format.CopyFrom(_response_format(response_format))
    kwargs = body.obj("chat_template_kwargs")
    if kwargs is not None:
        request.chat_template_kwargs.CopyFrom(_struct(kwargs, "chat_template_kwargs"))
    template = body.string("chat_template")
    if template is not None:
        request.chat_template = template
    add = body.boolean("add_generation_prompt")
    if add is not None:
        request.add_generation_prompt = add
    request.continue_final_message = bool(body.boolean("continue_final_message"))
    request.usage_in_every_chunk = stream.continuous_usage
    _common(body, request)
    return ChatCall(model, request, stream, logprobs, answer_role(request))


def answer_role(request: render_pb2.RenderChatRequest) -> str:
    """The answer's role, as vLLM's server gives it (get_chat_request_role): RESPONSE_ROLE, or with
    `add_generation_prompt: false` the last message's, whose turn the model then continues."""
    if request.HasField("add_generation_prompt") and not request.add_generation_prompt and request.messages:
        return request.messages[-1].role
    return RESPONSE_ROLE


def _message(value: Any, where: str) -> chat_pb2.ChatMessage:
    if not isinstance(value, dict):
        raise invalid(where, f"must be a message object, not {_kind(value)}")
    for key, item in value.items():
        if key in MESSAGE_FIELDS or (key in MESSAGE_NULL_FIELDS and item is None):
            continue
        raise unsupported(f"{where}.{key}", "not supported in a message" if key in MESSAGE_NULL_FIELDS
                          else "unknown message field")
    message = chat_pb2.ChatMessage(role=_string(value.get("role"), f"{where}.role", required=True))
    content = value.get("content")
    if isinstance(content, str):
        message.content = content
    elif isinstance(content, list):
        message.content_parts.extend(_part(item, f"{where}.content[{i}]") for i, item in enumerate(content))
    elif content is not None:
        raise invalid(f"{where}.content", f"must be a string or an array of content parts, not {_kind(content)}")
    name = _string(value.get("name"), f"{where}.name")
    if name:
        message.name = name
    call_id = _string(value.get("tool_call_id"), f"{where}.tool_call_id")
    if call_id:
        message.tool_call_id = call_id
    # vLLM 0.32 answers with `reasoning`; older clients send back `reasoning_content`.
    for key in ("reasoning", "reasoning_content"):
        reasoning = _string(value.get(key), f"{where}.{key}")
        if reasoning is not None:
            message.reasoning_content = reasoning
    calls = value.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", f"must be an array, not {_kind(calls)}")
        message.tool_calls.extend(_tool_call(item, f"{where}.tool_calls[{i}]") for i, item in enumerate(calls))
    return message


#: OpenAI's image_url.detail values.
IMAGE_DETAILS = ("auto", "low", "high")


def _part(value: Any, where: str) -> chat_pb2.ContentPart:
    if not isinstance(value, dict):
        raise invalid(where, f"must be a content part object, not {_kind(value)}")
    kind = _string(value.get("type"), f"{where}.type", required=True)
    if kind == "text":
        _only(value, ("type", "text"), where)
        return chat_pb2.ContentPart(text=_string(value.get("text"), f"{where}.text", required=True))
    if kind == "image_url":
        _only(value, ("type", "image_url"), where)
        image = value.get("image_url")
        if isinstance(image, dict):
            _only(image, ("url", "detail"), f"{where}.image_url")
            url = _string(image.get("url"), f"{where}.image_url.url", required=True)
            # Ignored, as vLLM ignores it: the model's processor sets each image's resolution.
            detail = _string(image.get("detail"), f"{where}.image_url.detail")
            if detail not in (None, *IMAGE_DETAILS):
                raise invalid(f"{where}.image_url.detail", f"must be one of {', '.join(IMAGE_DETAILS)}, "
                                                            f"not {detail[:64]!r}")
        else:
            url = _string(image, f"{where}.image_url", required=True)
        return chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=url))
    raise unsupported(f"{where}.type", f"content part type {kind[:64]!r} is not supported (text, image_url)")


def _only(value: dict, keys: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in keys:
            raise unsupported(f"{where}.{key}", "unknown field")


def _tool_call(value: Any, where: str) -> chat_pb2.ToolCall:
    if not isinstance(value, dict):
        raise invalid(where, f"must be a tool call object, not {_kind(value)}")
    _only(value, ("id", "type", "function", "index"), where)
    kind = _string(value.get("type"), f"{where}.type") or "function"
    if kind != "function":
        raise unsupported(f"{where}.type", "only function tool calls")
    function = value.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "is required: an object with name and arguments")
    _only(function, ("name", "arguments"), f"{where}.function")
    call = chat_pb2.ToolCall(id=_string(value.get("id"), f"{where}.id") or "", type="function")
    call.function.name = _string(function.get("name"), f"{where}.function.name", required=True)
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        call.function.arguments_object.CopyFrom(_struct(arguments, f"{where}.function.arguments"))
    else:
        call.function.arguments = _string(arguments, f"{where}.function.arguments") or "{}"
    return call


def _tool(value: Any, where: str) -> chat_pb2.Tool:
    if not isinstance(value, dict):
        raise invalid(where, f"must be a tool object, not {_kind(value)}")
    _only(value, ("type", "function"), where)
    if (_string(value.get("type"), f"{where}.type") or "function") != "function":
        raise unsupported(f"{where}.type", "only function tools")
    function = value.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "is required: an object with a name")
    _only(function, ("name", "description", "parameters", "strict"), f"{where}.function")
    tool = chat_pb2.Tool(type="function")
    tool.function.name = _string(function.get("name"), f"{where}.function.name", required=True)
    tool.function.description = _string(function.get("description"), f"{where}.function.description") or ""
    parameters = _schema(function.get("parameters"), f"{where}.function.parameters")
    if parameters is not None:
        tool.function.parameters.CopyFrom(parameters)
    strict = _boolean(function.get("strict"), f"{where}.function.strict")
    if strict is not None:
        tool.function.strict = strict
    return tool


MODES = {"auto": chat_pb2.TOOL_CHOICE_MODE_AUTO, "none": chat_pb2.TOOL_CHOICE_MODE_NONE,
         "required": chat_pb2.TOOL_CHOICE_MODE_REQUIRED}


def _tool_choice(value: Any) -> chat_pb2.ToolChoice:
    if isinstance(value, str):
        if value not in MODES:
            raise invalid("tool_choice", f"must be \"auto\", \"none\", \"required\" or a function, not {value[:64]!r}")
        return chat_pb2.ToolChoice(mode=MODES[value])
    if isinstance(value, dict):
        _only(value, ("type", "function"), "tool_choice")
        function = value.get("function")
        if value.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        _only(function, ("name",), "tool_choice.function")
        return chat_pb2.ToolChoice(function_name=_string(function.get("name"), "tool_choice.function.name",
                                                         required=True))
    raise invalid("tool_choice", f"must be a string or an object, not {_kind(value)}")


def _response_format(value: dict) -> render_pb2.ResponseFormat:
    _only(value, ("type", "json_schema"), "response_format")
    result = render_pb2.ResponseFormat(type=_string(value.get("type"), "response_format.type", required=True))
    schema = value.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema", "must be an object with name and schema")
        where = "response_format.json_schema"
        _only(schema, ("name", "description", "schema", "strict"), where)
        result.json_schema.name = _string(schema.get("name"), f"{where}.name") or ""
        result.json_schema.description = _string(schema.get("description"), f"{where}.description") or ""
        inner = _schema(schema.get("schema"), f"{where}.schema")
        if inner is not None:
            result.json_schema.schema.CopyFrom(inner)
        strict = _boolean(schema.get("strict"), f"{where}.strict")
        if strict is not None:
            result.json_schema.strict = strict
    return result


# -- completions --------------------------------------------------------------------------------

def parse_completion(values: dict[str, Any], served_model: str, adapters: Container[str] = ()) -> CompletionCall:
    """`adapters`: as parse_chat's."""
    body = Body(values, COMPLETION_PARAMETERS)
    model = check_model(body, served_model, adapters)
    stream = _stream_options(body)
    template = render_pb2.RenderCompletionRequest(lora_name=_adapter(model, served_model))
    sampling = _sampling(body)
    logprobs = body.integer("logprobs", 0, 20)
    if logprobs is not None:
        sampling.logprobs = True
        sampling.top_logprobs = logprobs
    template.sampling.CopyFrom(sampling)
    add = body.boolean("add_special_tokens")
    if add is not None:
        template.add_special_tokens = add
    template.usage_in_every_chunk = stream.continuous_usage
    _common(body, template)
    echo = bool(body.boolean("echo"))
    if echo and logprobs is not None:
        # vLLM answers it with the prompt tokens' logprobs, which tito's engines do not compute.
        raise unsupported("echo", "echo with logprobs needs the prompt's logprobs, which tito does not compute")
    requests = []
    for prompt in _prompts(body.get("prompt")):
        request = render_pb2.RenderCompletionRequest()
        request.CopyFrom(template)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        requests.append(request)
    return CompletionCall(model, tuple(requests), stream, logprobs, echo)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, an array of token ids, or an array of several prompts (each a
    string or an array of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return [_token_ids(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        if len(prompt) > MAX_COMPLETION_PROMPTS:
            raise invalid("prompt", f"holds {len(prompt)} prompts, more than {MAX_COMPLETION_PROMPTS}")
        return [item if isinstance(item, str) else _token_ids(item, f"prompt[{i}]") for i, item in enumerate(prompt)]
    raise invalid("prompt", "is required: a string, an array of token ids, or an array of those" if prompt is None
                  else "must be a string, an array of token ids, or an array of strings or of token-id arrays, "
                       f"not {_kind(prompt)}")


def _token_ids(values: list, name: str) -> list[int]:
    if not isinstance(values, list):
        raise invalid(name, f"must be an array of token ids, not {_kind(values)}")
    return [_integer(item, f"{name}[{i}]", 0, UINT32_MAX) for i, item in enumerate(values)]
