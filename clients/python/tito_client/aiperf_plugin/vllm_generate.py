"""The `vllm_generate` endpoint: AIPerf's text prompts in, vLLM's `GenerateRequest` out, and the
token ids of its answers (whole or streamed) back as AIPerf's responses and usage.

The request (vLLM 0.32, vllm/entrypoints/scale_out/token_in_token_out/protocol.py) is
`{"token_ids": [...], "sampling_params": {...}, "model": ..., "stream": ...}`. The prompt's ids
come from the tokenizer AIPerf synthesizes its prompts with, encoded as AIPerf counts them (no
special tokens added): the one named by the extra input `tokenizer` (`--extra-inputs
tokenizer:NAME`, never sent; give it the value of `--tokenizer`), else the model's name, AIPerf's
own default for `--tokenizer`. Endpoints are built without AIPerf's settings, so the plugin
cannot read `--tokenizer` itself. Other extra inputs go where vLLM reads them: its `GenerateRequest` fields
(`cache_salt`, `request_id`, `stream_options`, ...) at the top of the body, everything else
(`ignore_eos`, `min_tokens`, `temperature`, ...) into `sampling_params`; AIPerf's
`--output-tokens-mean` is `sampling_params.max_tokens`. A stream asks for usage
(`stream_options.include_usage`) unless told otherwise, as AIPerf's completions endpoint does.

The answer: each choice's `token_ids` (a stream's chunks carry the new ones) become a text
response (the ids decoded, so AIPerf's client-side counting has text to work on; left empty
under `--use-server-token-count`, which never reads it), and the
request's usage is the server's with `completion_tokens` set to the ids actually received: with
`--use-server-token-count` AIPerf's output counts are exact, not a re-tokenization of decoded
text (which merges and splits tokens differently). An `{"error": ...}` body or chunk fails the
request with the server's message.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiperf.common.models import (
    ExtractedPayload,
    InferenceServerResponse,
    ParsedResponse,
    RequestInfo,
    RequestRecord,
    TextResponseData,
    Usage,
)
from aiperf.endpoints.base_endpoint import BaseEndpoint

#: The extra input that names the tokenizer; the plugin's own, never sent.
TOKENIZER_INPUT = "tokenizer"
#: vLLM's `GenerateRequest` fields: an extra input of one of these names goes at the top of the
#: body, any other into `sampling_params`.
REQUEST_FIELDS = frozenset({
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "stream", "stream_options",
    "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
})
#: Where a parsed response keeps how many token ids it carried.
TOKEN_COUNT = "token_ids"


class GenerateError(RuntimeError):
    """The server answered (or ended a stream) with vLLM's error JSON."""


def split_inputs(inputs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the body's top-level fields, sampling parameters) from AIPerf's extra inputs or a turn's
    extra body; a `sampling_params` object among them is merged into the latter."""
    top = {key: value for key, value in inputs.items() if key in REQUEST_FIELDS and key != "sampling_params"}
    sampling = {key: value for key, value in inputs.items() if key not in REQUEST_FIELDS}
    sampling.update(inputs.get("sampling_params") or {})
    return top, sampling


class _LocalTokenizer:
    """A model directory's tokenizer.json through the `tokenizers` library: what AIPerf's
    `Tokenizer` (transformers' fast tokenizer over the same file) encodes and decodes, without
    importing transformers (seconds on a small machine) in every AIPerf process."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self._tokenizer = FastTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def load_tokenizer(name: str):
    """The tokenizer AIPerf would load for `name`: a directory's tokenizer.json directly, anything
    else (a hub id, a tiktoken encoding) through AIPerf's own `Tokenizer`."""
    local = Path(name) / "tokenizer.json"
    if local.is_file():
        return _LocalTokenizer(local)
    from aiperf.common.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(name)


class VllmGenerateEndpoint(BaseEndpoint):
    """vLLM's `POST /inference/v1/generate`, whole or streamed (SSE), for one-turn text prompts."""

    def __init__(self, model_endpoint, **kwargs) -> None:
        super().__init__(model_endpoint, **kwargs)
        extra = dict(model_endpoint.endpoint.extra or [])
        name = extra.pop(TOKENIZER_INPUT, None) or model_endpoint.primary_model_name
        self._extra = extra
        # Loaded from the start, off the event loop: the first request must not wait for it, or
        # its latency (and the run's throughput) would include a tokenizer's load.
        loader = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._tokenizer: Future = loader.submit(load_tokenizer, name)
        loader.shutdown(wait=False)
        # AIPerf reads output counts from usage then, so decoded text would go unused.
        self._decode = not model_endpoint.endpoint.use_server_token_count

    def format_payload(self, request_info: RequestInfo) -> dict[str, Any]:
        if len(request_info.turns) != 1:
            raise ValueError("vllm_generate sends one turn per request (a token-in prompt has no chat history)")
        turn = request_info.turns[0]
        model = turn.model or self.model_endpoint.primary_model_name
        text = " ".join(content for item in turn.texts for content in item.contents if content)
        top, sampling = split_inputs(self._extra)
        turn_top, turn_sampling = split_inputs(turn.extra_body or {})
        if turn.max_tokens:
            sampling = {"max_tokens": turn.max_tokens, **sampling}
        payload: dict[str, Any] = {
            "token_ids": self._tokenizer.result().encode(text),
            "sampling_params": {**sampling, **turn_sampling},
            "model": model,
            "stream": self.model_endpoint.endpoint.streaming,
            **top, **turn_top,
        }
        if payload["stream"] and payload.get("stream_options") is None:
            payload["stream_options"] = {"include_usage": True}
        return payload

    def extract_payload_inputs(self, payload: dict[str, Any]) -> ExtractedPayload:
        """The prompt is token ids: AIPerf's input length is their count, never a re-tokenization."""
        token_ids = payload.get("token_ids")
        return ExtractedPayload(pretokenised_token_count=len(token_ids) if isinstance(token_ids, list) else 0)

    def parse_response(self, response: InferenceServerResponse) -> ParsedResponse | None:
        body = response.get_json()
        if not isinstance(body, dict):
            return None
        if "error" in body:
            error = body["error"]
            raise GenerateError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        token_ids = [token for choice in body.get("choices") or [] for token in choice.get("token_ids") or []]
        usage = body.get("usage") or None
        if not token_ids and usage is None:
            return None
        data = None
        if token_ids:
            data = TextResponseData(text=self._tokenizer.result().decode(token_ids) if self._decode else "")
        return ParsedResponse(perf_ns=response.perf_ns, data=data, usage=usage,
                              metadata={TOKEN_COUNT: len(token_ids)})

    def extract_response_data(self, record: RequestRecord) -> list[ParsedResponse]:
        """The responses, the last one carrying the request's usage with the received ids' count."""
        if record._parsed_responses_cache is not None:
            return record._parsed_responses_cache
        parsed = super().extract_response_data(record)
        if parsed:
            received = sum(response.metadata.get(TOKEN_COUNT, 0) for response in parsed)
            server = next((dict(response.usage) for response in reversed(parsed) if response.usage), {})
            usage = {**server, "completion_tokens": received}
            if isinstance(server.get("prompt_tokens"), int):
                usage["total_tokens"] = server["prompt_tokens"] + received
            parsed[-1].usage = Usage(usage)
        return parsed
