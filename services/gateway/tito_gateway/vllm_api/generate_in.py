"""vLLM's `GenerateRequest` JSON (POST /inference/v1/generate) -> the engine's GenerateRequest.

Domain code: no HTTP here. Every field vLLM 0.32 defines is either mapped, accepted where it
cannot change the tokens (text options, with `output_mode` "tokens"), or refused with a 400
naming it (`sampling_params.stop`, `ec_transfer_params`, ...): never silently dropped.
`kv_transfer_params` (vLLM's prefill/decode handoff) becomes the engine's typed `kv_transfer`
(tito.kv_params). Media
arrive as `features` (hashes and placeholders, with vLLM's serialized tensors in `kwargs_data` /
`mm_metadata` where the vllm package is installed: mm_serde) or as `content_parts`, which the
caller (routes) has render render (media). `sampling_params` holds vLLM's `SamplingParams`
names; a field vLLM would not know is a 400 too. Ranges the engine checks itself (temperature,
top_p, logprobs <= 20, ids in the vocabulary, placeholders inside the prompt) are left to it, so
this face and a gRPC caller are refused alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tito import kv_params
from tito.errors import NotFound
from tito.v1 import engine_pb2, multimodal_pb2, sampling_pb2
from tito_gateway import openai_in
from tito_gateway.openai_in import invalid, unsupported
from tito_gateway.vllm_api import media, mm_serde

UINT32_MAX = openai_in.UINT32_MAX
#: vLLM's bound on `cache_salt` (GenerateRequest.cache_salt).
MAX_CACHE_SALT_CHARS = 1024

REQUEST_FIELDS = frozenset((
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "stream", "stream_options",
    "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params"))

#: Request fields refused when set (not null), with why.
REFUSED_FIELDS = {
    "ec_transfer_params": "encoder-cache transfer parameters are not supported; send features the engine holds",
}

#: SamplingParams fields that shape only the text, which a tokens-mode generate does not produce:
#: accepted (a GenerateRequest from vLLM's render carries them) and not used here.
TEXT_ONLY = frozenset(("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                       "detokenize", "output_kind", "skip_clone", "stream_interval", "flat_logprobs",
                       "output_text_buffer_length"))

#: SamplingParams fields tito's engines do not implement: refused unless they hold vLLM's
#: default (the value a render output carries when the caller asked for nothing).
REFUSED_SAMPLING = {
    "stop": ([], "tito's engines see tokens only: stop strings are applied by derender "
                 "(/v1/chat/completions/derender); use stop_token_ids here"),
    "prompt_logprobs": (None, "prompt logprobs are not computed by tito's engines"),
    "prompt_logprob_token_ids": (None, "prompt logprobs are not computed by tito's engines"),
    "prompt_logprob_start": (None, "prompt logprobs are not computed by tito's engines"),
    "logprob_token_ids": (None, "logprobs of chosen token ids are not supported"),
    "allowed_token_ids": (None, "use logit_bias"),
    "bad_words": ([], "bad words are not supported"),
    "extra_args": (None, "extra_args are not supported"),
    "thinking_token_budget": (None, "a thinking budget is not supported"),
    "repetition_detection": (None, "repetition detection is not supported"),
    "watermarking": (None, "watermarking is not supported"),
    "skip_reading_prefix_cache": (False, "the prefix cache cannot be skipped per request"),
    "routed_experts_prompt_start": (None, "routed experts are not returned"),
    "trace_decode_token_ids": (None, "decode tracing is not supported"),
    "truncate_prompt_tokens": (None, "truncation is render's: send the prompt you want run"),
}

OPTIONAL_FLOATS = ("temperature", "top_p", "repetition_penalty")
PLAIN_FLOATS = ("presence_penalty", "frequency_penalty", "min_p")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OPTIONS = {"disable_any_whitespace": False, "disable_additional_properties": False,
                      "whitespace_pattern": None, "disable_fallback": False, "_backend": None,
                      "_backend_was_auto": False}
MODALITIES = {"image": multimodal_pb2.MODALITY_IMAGE, "video": multimodal_pb2.MODALITY_VIDEO,
              "audio": multimodal_pb2.MODALITY_AUDIO}
SAMPLING_FIELDS = frozenset((*OPTIONAL_FLOATS, *PLAIN_FLOATS, "n", "seed", "top_k", "max_tokens", "min_tokens",
                             "ignore_eos", "stop_token_ids", "logprobs", "logit_bias", "structured_outputs",
                             *TEXT_ONLY, *REFUSED_SAMPLING))


@dataclass
class GenerateCall:
    """A generate request, parsed: what the engine gets and how to answer."""

    request: engine_pb2.GenerateRequest
    model: str | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # vLLM's count: None no logprobs, k the sampled token and k-1 others
    return_token_ids: bool = False
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    #: vLLM's content_parts as OpenAI content parts, for render to render (None: no such media)
    content_parts: list[dict] | None = None


def parse_generate(values: dict[str, Any], served_model: str) -> GenerateCall:
    for name in values:
        if name not in REQUEST_FIELDS:
            raise unsupported(name, "unknown field of vLLM's GenerateRequest")
    for name, why in REFUSED_FIELDS.items():
        if values.get(name):
            raise unsupported(name, why)
    body = openai_in.Body(values, REQUEST_FIELDS)
    model = body.string("model")
    if model is not None and model != served_model:
        raise NotFound(f"The model `{model[:256]}` does not exist.", reason=openai_in.MODEL_NOT_FOUND)
    mode = body.string("output_mode")
    if mode not in (None, "tokens"):
        raise unsupported("output_mode", "only \"tokens\": the engine returns token ids and derender makes text "
                                         "(/v1/chat/completions/derender)")
    priority = body.integer("priority", -(2**63), 2**63 - 1)
    if priority:
        raise unsupported("priority", "tito's engines schedule first come, first served")
    body.boolean("reasoning_ended")  # vLLM's engine-side reasoning gate; render already wrapped any constraint
    body.obj("reasoning_parser_kwargs")
    request = engine_pb2.GenerateRequest(token_ids=prompt_ids(values.get("token_ids"), "token_ids"))
    if values.get("kv_transfer_params") is not None:
        transfer = kv_params.kv_transfer_from_params(values["kv_transfer_params"])
        if transfer is not None:
            request.kv_transfer.CopyFrom(transfer)
    request_id = body.string("request_id")
    if request_id:
        request.request_id = request_id
    salt = body.string("cache_salt")
    if salt is not None:
        if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
            raise invalid("cache_salt", f"must hold 1 to {MAX_CACHE_SALT_CHARS} characters")
        request.cache_salt = salt
    features = body.obj("features")
    parts = values.get("content_parts")
    if parts and features:
        raise invalid("content_parts", "content_parts and features are mutually exclusive")
    if features is not None:
        request.mm_features.CopyFrom(parse_features(features, len(request.token_ids)))
    sampling = body.obj("sampling_params")
    if sampling is None:
        raise invalid("sampling_params", "is required: vLLM's SamplingParams as an object")
    params, logprobs = parse_sampling(sampling)
    request.sampling_params.CopyFrom(params)
    stream = bool(body.boolean("stream"))
    options = body.obj("stream_options") or {}
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unsupported(f"stream_options.{key}", "unknown stream option")
    include_usage = bool(openai_in._boolean(options.get("include_usage"), "stream_options.include_usage"))
    continuous = bool(openai_in._boolean(options.get("continuous_usage_stats"),
                                         "stream_options.continuous_usage_stats"))
    return GenerateCall(request, model, stream, include_usage, include_usage and continuous, logprobs,
                        bool(body.boolean("return_token_ids")), frozenset(params.stop_token_ids),
                        media.chat_parts(parts) if parts else None)


def prompt_ids(value: Any, name: str) -> list[int]:
    """A non-empty list of non-negative integers of JSON's integer type: `true` and `1.0` are
    refused (the engine checks the vocabulary)."""
    if not isinstance(value, list) or not value:
        raise invalid(name, "is required: a non-empty array of token ids" if value is None or value == []
                      else f"must be an array of token ids, not {openai_in._kind(value)}")
    for index, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= UINT32_MAX:
            raise invalid(f"{name}[{index}]", f"must be a non-negative integer token id, not {json.dumps(item)[:32]}")
    return value


def parse_sampling(values: dict[str, Any]) -> tuple[sampling_pb2.SamplingParams, int | None]:
    """vLLM's SamplingParams JSON -> the engine's, and vLLM's logprobs count."""
    for name, value in values.items():
        if name not in SAMPLING_FIELDS:
            raise unsupported(f"sampling_params.{name[:64]}", "unknown field of vLLM's SamplingParams")
        if name in REFUSED_SAMPLING and value is not None and value != REFUSED_SAMPLING[name][0]:
            raise unsupported(f"sampling_params.{name}", REFUSED_SAMPLING[name][1])
    body = openai_in.Body({f"sampling_params.{k}": v for k, v in values.items()},
                          frozenset(f"sampling_params.{k}" for k in values))
    params = sampling_pb2.SamplingParams()
    for name in (*OPTIONAL_FLOATS, *PLAIN_FLOATS):
        number = body.number(f"sampling_params.{name}")
        if number is not None:
            setattr(params, name, number)
    for name, low in (("n", 1), ("max_tokens", 1), ("min_tokens", 0)):
        count = body.integer(f"sampling_params.{name}", low, UINT32_MAX)
        if count is not None:
            setattr(params, name, count)
    seed = body.integer("sampling_params.seed", -(2**63), 2**64 - 1)
    if seed is not None:
        params.seed = seed % 2**64  # vLLM takes any int; the engine's seed is its 64 bits
    top_k = body.integer("sampling_params.top_k", -1, openai_in.INT32_MAX)
    if top_k is not None:
        params.top_k = top_k
    if body.boolean("sampling_params.ignore_eos"):
        params.ignore_eos = True
    stops = values.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("sampling_params.stop_token_ids", "must be an array of token ids")
        params.stop_token_ids.extend(openai_in._integer(item, f"sampling_params.stop_token_ids[{i}]", 0, UINT32_MAX)
                                     for i, item in enumerate(stops))
    logprobs = body.integer("sampling_params.logprobs", -1, UINT32_MAX)
    if logprobs == -1:
        raise unsupported("sampling_params.logprobs", "-1 (the whole vocabulary) is not supported; at most 20")
    if logprobs is not None:
        params.logprobs = True
        params.top_logprobs = logprobs
    bias = body.obj("sampling_params.logit_bias")
    if bias:
        params.logit_bias.update(openai_in._logit_bias(bias))
    structured = body.obj("sampling_params.structured_outputs")
    if structured is not None:
        params.structured_output.CopyFrom(parse_structured(structured))
    return params, logprobs


def parse_structured(values: dict[str, Any]) -> sampling_pb2.StructuredOutput:
    """vLLM's StructuredOutputsParams -> the engine's StructuredOutput (exactly one kind)."""
    where = "sampling_params.structured_outputs"
    for name, value in values.items():
        if name in STRUCTURED_KINDS:
            continue
        if name not in STRUCTURED_OPTIONS:
            raise unsupported(f"{where}.{name[:64]}", "unknown field of vLLM's StructuredOutputsParams")
        if value is not None and value != STRUCTURED_OPTIONS[name]:
            raise unsupported(f"{where}.{name}", "not supported by tito's structured outputs")
    given = [name for name in STRUCTURED_KINDS if values.get(name) not in (None, False)]
    if len(given) != 1:
        raise invalid(where, f"set exactly one of {', '.join(STRUCTURED_KINDS)}")
    kind, value = given[0], values[given[0]]
    out = sampling_pb2.StructuredOutput()
    if kind == "json":
        out.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        out.json_object.SetInParent()
    elif kind == "choice":
        if not isinstance(value, list):
            raise invalid(f"{where}.choice", "must be an array of strings")
        out.choice.choices.extend(openai_in._string(item, f"{where}.choice[{i}]", True) for i, item in enumerate(value))
    else:
        setattr(out, kind, openai_in._string(value, f"{where}.{kind}"))
    return out


def parse_features(values: dict[str, Any], prompt_length: int, name: str = "features"
                   ) -> multimodal_pb2.MultiModalFeatures:
    """vLLM's MultiModalFeatures (per-modality parallel lists) -> the engine's items in prompt
    order. An item with `kwargs_data` carries its tensors (the engine runs the encoder); one
    with `mm_metadata` only, or neither, is tito's METADATA path: the engine serves it from its
    encoder cache (the caller fills in metadata it kept for a hashes-only item: media.KeptMetadata).
    `name`: the field they came in, for the errors."""
    for key in values:
        if key not in ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"):
            raise unsupported(f"{name}.{key[:64]}", "unknown field of vLLM's MultiModalFeatures")
    hashes, places = values.get("mm_hashes"), values.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(places, dict):
        raise invalid(name, "needs mm_hashes and mm_placeholders, each an object of per-modality arrays")
    if set(hashes) != set(places):
        raise invalid(f"{name}.mm_placeholders", "mm_hashes and mm_placeholders must use the same modalities")
    serialized = {key: _serialized_lists(values.get(key), f"{name}.{key}", hashes)
                  for key in ("kwargs_data", "mm_metadata")}
    items = []
    for modality, modality_hashes in hashes.items():
        where = f"{name}.mm_hashes.{modality[:32]}"
        if modality not in MODALITIES:
            raise unsupported(where, f"modality {modality[:32]!r} is not one of {', '.join(MODALITIES)}")
        ranges = places[modality]
        if not isinstance(modality_hashes, list) or not isinstance(ranges, list) or len(modality_hashes) != len(ranges):
            raise invalid(f"{name}.mm_placeholders.{modality}",
                          f"{modality} mm_hashes and mm_placeholders must be arrays of the same length")
        for index, (mm_hash, place) in enumerate(zip(modality_hashes, ranges)):
            at = f"{name}.mm_placeholders.{modality}[{index}]"
            item = multimodal_pb2.MultiModalItem(
                modality=MODALITIES[modality], mm_hash=openai_in._string(mm_hash, f"{where}[{index}]", True),
                placeholder=_placeholder(place, at, prompt_length))
            for key, lists in serialized.items():
                data = lists.get(modality, [None] * len(ranges))[index] if lists else None
                if data is not None:
                    kwargs, metadata = mm_serde.decode_item(data, f"{name}.{key}.{modality}[{index}]")
                    for key, tensor in kwargs.items():
                        item.kwargs[key].CopyFrom(tensor)
                    for key, tensor in metadata.items():
                        item.metadata[key].CopyFrom(tensor)
            items.append(item)
    items.sort(key=lambda item: item.placeholder.offset)
    for before, after in zip(items, items[1:]):
        if after.placeholder.offset < before.placeholder.offset + before.placeholder.length:
            raise invalid(f"{name}.mm_placeholders", "mm_placeholders must be globally non-overlapping")
    return multimodal_pb2.MultiModalFeatures(items=items)


def _serialized_lists(lists: Any, name: str, hashes: dict) -> dict[str, list]:
    """`kwargs_data` / `mm_metadata` (`name` their field): per-modality arrays parallel to
    `mm_hashes` (or null)."""
    if lists is None:
        return {}
    if not isinstance(lists, dict) or set(lists) != set(hashes):
        raise invalid(name, "must be an object using the same modalities as mm_hashes")
    for modality, entries in lists.items():
        expected = hashes[modality]
        if not isinstance(entries, list) or not isinstance(expected, list) or len(entries) != len(expected):
            raise invalid(f"{name}.{modality[:32]}", "must have as many entries as mm_hashes")
    return lists


def _placeholder(value: Any, where: str, prompt_length: int) -> multimodal_pb2.PlaceholderRange:
    """One PlaceholderRangeInfo, with the optional `is_embed` mask vLLM's open change adds."""
    if not isinstance(value, dict):
        raise invalid(where, "must be an object with offset and length")
    for key in value:
        if key not in ("offset", "length", "is_embed"):
            raise unsupported(f"{where}.{key[:64]}", "unknown field of vLLM's PlaceholderRangeInfo")
    offset = openai_in._integer(value.get("offset"), f"{where}.offset", 0, UINT32_MAX)
    length = openai_in._integer(value.get("length"), f"{where}.length", 1, UINT32_MAX)
    if offset is None or length is None:
        raise invalid(where, "needs offset and length")
    if offset + length > prompt_length:
        raise invalid(where, "mm_placeholders must remain within the token_ids sequence")
    placeholder = multimodal_pb2.PlaceholderRange(offset=offset, length=length)
    mask = value.get("is_embed")
    if mask is not None:
        if not isinstance(mask, list) or any(type(flag) is not bool for flag in mask) or len(mask) != length:
            raise invalid(f"{where}.is_embed", "must be an array of `length` booleans")
        placeholder.is_embed.extend(mask)
    return placeholder
