"""Render's response -> vLLM's `GenerateRequest` JSON, as `/v1/chat/completions/render` and
`/v1/completions/render` answer (ready to POST to /inference/v1/generate, tito's or vLLM's).

Domain code: no HTTP here. `sampling_params` holds render's resolved values under vLLM's
`SamplingParams` names, only those that differ from vLLM's defaults (as vLLM dumps them); the
string options (stop strings, skip_special_tokens, ...) come from derender's context, where
render puts them. Media items are hashes and placeholders, with each item's tensors in vLLM's
serialized form when the caller asked for them (`mm_payload` "tensors", written with vLLM's own
serializer: mm_serde)."""

from __future__ import annotations

import json

from tito.v1 import derender_pb2, engine_pb2, sampling_pb2
from tito_gateway.vllm_api.generate_out import features_json

#: vLLM's SamplingParams defaults for the fields render resolves.
DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
            "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False}


def sampling_json(params: sampling_pb2.SamplingParams, text: sampling_pb2.OutputTextOptions) -> dict:
    """Render's SamplingParams (and derender's text options) under vLLM's names."""
    out: dict = {}
    values = {"n": params.n if params.HasField("n") else 1,
              "temperature": params.temperature if params.HasField("temperature") else 1.0,
              "top_p": params.top_p if params.HasField("top_p") else 1.0,
              "top_k": params.top_k, "min_p": params.min_p,
              "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
              "repetition_penalty": params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
              "min_tokens": params.min_tokens, "ignore_eos": params.ignore_eos,
              "skip_special_tokens": text.skip_special_tokens if text.HasField("skip_special_tokens") else True,
              # tito's default is the tokenizer's own decode (False); vLLM's is True: always say which.
              "spaces_between_special_tokens": text.spaces_between_special_tokens,
              "include_stop_str_in_output": text.include_stop_str_in_output}
    for name, value in values.items():
        if isinstance(value, float):
            value = round(value, 6)  # float32 on the wire: 0.7 arrives as 0.699999988
        if name == "spaces_between_special_tokens" or value != DEFAULTS[name]:
            out[name] = value
    if params.HasField("seed"):
        out["seed"] = params.seed
    out["stop"] = list(text.stop)
    out["stop_token_ids"] = list(params.stop_token_ids)
    if params.HasField("max_tokens"):
        out["max_tokens"] = params.max_tokens
    if params.logprobs:
        out["logprobs"] = params.top_logprobs
    if params.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in sorted(params.logit_bias.items())}
    if params.HasField("structured_output"):
        out["structured_outputs"] = structured_json(params.structured_output)
    return out


def structured_json(constraint: sampling_pb2.StructuredOutput) -> dict:
    kind = constraint.WhichOneof("constraint")
    if kind == "json_schema":
        return {"json": json.loads(constraint.json_schema)}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": list(constraint.choice.choices)}
    return {kind: getattr(constraint, kind)}


def generate_request_json(request: engine_pb2.GenerateRequest, context: derender_pb2.DerenderContext,
                          model: str, stream: bool, stream_options: dict | None, with_tensors: bool = False) -> dict:
    """vLLM's GenerateRequest for one rendered request (fields in vLLM's order)."""
    features = features_json(request.mm_features, with_tensors) if request.mm_features.items else None
    return {"request_id": request.request_id, "token_ids": list(request.token_ids), "token_offsets": None,
            "features": features,
            "content_parts": None, "sampling_params": sampling_json(request.sampling_params, context.text_options),
            "model": model, "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens", "stream": stream, "stream_options": stream_options if stream else None,
            "cache_salt": request.cache_salt or None, "priority": 0, "kv_transfer_params": None,
            "ec_transfer_params": None}

