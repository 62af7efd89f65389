"""The engine's GenerateResponses -> vLLM's generate answer (`output_mode` "tokens"): a whole
`GenerateTokensResponse`, or SSE chunks (`GenerateTokensStreamResponse`, one per engine message
of a choice, then a usage chunk with `stream_options.include_usage`, then `data: [DONE]`).

Domain code: no HTTP here. Field order and presence follow vLLM 0.32's models as it dumps them
(a stream chunk leaves out `prompt_token_ids`, `mm_placeholders` and `metrics` when null, the
usage chunk every null). Logprobs carry integer token ids: `top_logprobs` holds the sampled
token first, then the most likely others, `max(k, 1)` entries for `logprobs: k`, as vLLM's
engine orders its per-position map."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tito.v1 import engine_pb2, multimodal_pb2
from tito_gateway.vllm_api import mm_serde
from tito_gateway.vllm_api.generate_in import GenerateCall

FINISH_REASONS = {engine_pb2.FINISH_REASON_STOP: "stop", engine_pb2.FINISH_REASON_LENGTH: "length",
                  engine_pb2.FINISH_REASON_ABORT: "abort"}
#: vLLM's floor for a logprob (-inf and NaN are not JSON).
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if value != value else max(float(value), LOGPROB_FLOOR)


def _entry(token: engine_pb2.TokenLogprob) -> dict:
    return {"token_id": token.token_id, "logprob": _logprob(token.logprob), "rank": token.rank or None}


def logprobs_json(positions, count: int) -> dict:
    """vLLM's GenerateLogProbs for `positions` (PositionLogprobs) under `logprobs: count`."""
    content = []
    for position in positions:
        ranked = [position.sampled, *(top for top in position.top if top.token_id != position.sampled.token_id)]
        content.append({**_entry(position.sampled),
                        "top_logprobs": [_entry(token) for token in ranked[:max(count, 1)]]})
    return {"content": content}


def stop_reason(response: engine_pb2.GenerateResponse, stop_token_ids: frozenset[int]) -> int | None:
    """vLLM's stop_reason: the stop token id that ended the choice, None for EOS (which the
    engine reports as its matched stop token too) and for every other end."""
    if response.HasField("matched_stop_token_id") and response.matched_stop_token_id in stop_token_ids:
        return response.matched_stop_token_id
    return None


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


@dataclass
class WholeChoice:
    token_ids: list[int] = field(default_factory=list)
    positions: list = field(default_factory=list)
    finish: engine_pb2.GenerateResponse | None = None


class Whole:
    """A whole answer collected from the engine's responses (all choices)."""

    def __init__(self, call: GenerateCall) -> None:
        self.call = call
        self.choices: dict[int, WholeChoice] = {}
        self.prompt_tokens = 0
        #: a prefill answer's handoff for the decode call (tito.kv_params), None otherwise
        self.kv_transfer_params: dict | None = None

    def add(self, response: engine_pb2.GenerateResponse) -> None:
        choice = self.choices.setdefault(response.index, WholeChoice())
        choice.token_ids.extend(response.token_ids)
        choice.positions.extend(response.logprobs)
        if response.finish_reason:
            choice.finish = response
            self.prompt_tokens = response.usage.prompt_tokens

    def json(self, response_id: str, model: str) -> dict:
        call = self.call
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            finish = choice.finish
            choices.append({
                "index": index,
                "finish_reason": FINISH_REASONS.get(finish.finish_reason, "stop") if finish else "stop",
                "stop_reason": stop_reason(finish, call.stop_token_ids) if finish else None,
                "token_ids": choice.token_ids, "routed_experts": None, "sampling_mask": None,
                "weight_versions": None,
                "logprobs": logprobs_json(choice.positions, call.logprobs) if call.logprobs is not None else None})
        completion = sum(len(choice.token_ids) for choice in self.choices.values())
        return {"request_id": response_id, "model": model, "created": int(time.time()),
                "usage": usage_json(self.prompt_tokens, completion), "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": list(call.request.token_ids) if call.return_token_ids else None,
                "mm_placeholders": placeholders_json(call.request) if call.return_token_ids else None,
                "metrics": None, "kv_transfer_params": self.kv_transfer_params, "ec_transfer_params": None,
                "output_mode": "tokens", "choices": choices}


def placeholders_json(request: engine_pb2.GenerateRequest) -> dict | None:
    """The prompt's placeholder ranges per modality (return_token_ids), None for a text prompt."""
    if not request.mm_features.items:
        return None
    return features_json(request.mm_features)["mm_placeholders"]


MODALITY_NAMES = {multimodal_pb2.MODALITY_IMAGE: "image", multimodal_pb2.MODALITY_VIDEO: "video",
                  multimodal_pb2.MODALITY_AUDIO: "audio"}


def features_json(features: multimodal_pb2.MultiModalFeatures, with_tensors: bool = False) -> dict:
    """tito's items (prompt order) -> vLLM's MultiModalFeatures: per-modality lists of hashes
    and placeholders; with `with_tensors` (render's `mm_payload` "tensors") also each item's
    tensors and its metadata alone in vLLM's serialized form (`kwargs_data`, `mm_metadata`:
    mm_serde). A placeholder carries `is_embed` where tito has the mask (vLLM's field is
    pending: its PlaceholderRangeInfo leaves it as a TODO; carried as its open change adds it)."""
    hashes: dict[str, list[str]] = {}
    places: dict[str, list[dict]] = {}
    kwargs_data: dict[str, list[str | None]] = {}
    metadata: dict[str, list[str | None]] = {}
    for item in features.items:
        modality = MODALITY_NAMES.get(item.modality, "image")
        hashes.setdefault(modality, []).append(item.mm_hash)
        place = {"offset": item.placeholder.offset, "length": item.placeholder.length}
        if item.placeholder.is_embed:
            place["is_embed"] = list(item.placeholder.is_embed)
        places.setdefault(modality, []).append(place)
        if with_tensors:
            kwargs_data.setdefault(modality, []).append(
                mm_serde.encode_item(item.kwargs, item.metadata) if item.kwargs else None)
            metadata.setdefault(modality, []).append(mm_serde.encode_item({}, item.metadata) if item.metadata else None)
    has_metadata = any(entry is not None for entries in metadata.values() for entry in entries)
    return {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": kwargs_data or None,
            "mm_metadata": metadata if has_metadata else None}


class Stream:
    """SSE chunks for one streamed generate."""

    def __init__(self, call: GenerateCall, response_id: str) -> None:
        self.call = call
        self.response_id = response_id
        self.prompt_tokens = 0
        self.generated: dict[int, int] = {}
        self.first = True

    def chunk(self, response: engine_pb2.GenerateResponse, kv_transfer_params: dict | None = None) -> dict | None:
        """The chunk for one engine message, None when it carries neither tokens nor an end.
        `kv_transfer_params`: a prefill answer's handoff, on the chunk that ends it (vLLM's streamed
        generate has no such field and drops its connector's answer; tito adds it so a router
        that streams the prefill call can still decode elsewhere)."""
        call = self.call
        if response.usage.prompt_tokens:
            self.prompt_tokens = response.usage.prompt_tokens
        self.generated[response.index] = self.generated.get(response.index, 0) + len(response.token_ids)
        if not response.token_ids and not response.finish_reason:
            return None
        out: dict = {"request_id": self.response_id, "usage": None}
        if self.first and call.return_token_ids:
            out["prompt_token_ids"] = list(call.request.token_ids)
            placeholders = placeholders_json(call.request)
            if placeholders is not None:
                out["mm_placeholders"] = placeholders
        self.first = False
        if call.continuous_usage:
            out["usage"] = usage_json(self.prompt_tokens or len(call.request.token_ids),
                                      self.generated[response.index])
        out["output_mode"] = "tokens"
        out["choices"] = [{
            "index": response.index, "finish_reason": FINISH_REASONS.get(response.finish_reason),
            "stop_reason": stop_reason(response, call.stop_token_ids) if response.finish_reason else None,
            "token_ids": list(response.token_ids), "routed_experts": None, "sampling_mask": None,
            "weight_versions": None,
            "logprobs": logprobs_json(response.logprobs, call.logprobs) if call.logprobs is not None else None}]
        if kv_transfer_params is not None:
            out["kv_transfer_params"] = kv_transfer_params
        return out

    def final(self) -> dict | None:
        """The usage chunk (stream_options.include_usage), else None."""
        if not self.call.include_usage:
            return None
        completion = sum(self.generated.values())
        usage = usage_json(self.prompt_tokens, completion)
        del usage["prompt_tokens_details"]
        return {"request_id": self.response_id, "usage": usage, "output_mode": "tokens", "choices": []}
