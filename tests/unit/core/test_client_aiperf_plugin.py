"""tito's AIPerf endpoint `vllm_generate` (tito_client.aiperf_plugin) without a server: AIPerf
finds it through tito's entry point, its requests are vLLM's GenerateRequest with the prompt as
the tokenizer's ids, and the token ids of the answers (whole or streamed) are what AIPerf counts.
tests/e2e/test_e2e_gateway_vllm_api.py runs `aiperf profile` with it against the gateway."""

from __future__ import annotations

import json
import time

import pytest
from aiperf.common.enums import CreditPhase, ModelSelectionStrategy
from aiperf.common.models import RequestInfo, RequestRecord, SSEMessage, Text, TextResponse, Turn
from aiperf.common.models.model_endpoint_info import EndpointInfo, ModelEndpointInfo, ModelInfo, ModelListInfo
from aiperf.plugin import plugins
from aiperf.plugin.enums import PluginType
from tokenizers import Tokenizer

from tito_client.aiperf_plugin.vllm_generate import GenerateError, VllmGenerateEndpoint

PROMPT = "Tell me about the number seven."


def _endpoint(model_dir, streaming: bool = False, server_counts: bool = True, **extra) -> VllmGenerateEndpoint:
    info = ModelEndpointInfo(
        models=ModelListInfo(models=[ModelInfo(name="served")],
                             model_selection_strategy=ModelSelectionStrategy.ROUND_ROBIN),
        endpoint=EndpointInfo(type="vllm_generate", streaming=streaming, use_server_token_count=server_counts,
                              extra=[("tokenizer", str(model_dir)), *extra.items()]))
    return plugins.get_class(PluginType.ENDPOINT, "vllm_generate")(model_endpoint=info)


def _payload(endpoint: VllmGenerateEndpoint, max_tokens: int | None = 16, **extra_body) -> dict:
    turn = Turn(texts=[Text(contents=[PROMPT])], max_tokens=max_tokens, extra_body=extra_body or None)
    return endpoint.format_payload(RequestInfo(
        model_endpoint=endpoint.model_endpoint, turns=[turn], turn_index=0, credit_num=0,
        credit_phase=CreditPhase.PROFILING, x_request_id="r", x_correlation_id="c", conversation_id="s"))


def _sse(*bodies) -> list[SSEMessage]:
    now = time.perf_counter_ns()
    return [SSEMessage.parse(f"data: {body if isinstance(body, str) else json.dumps(body)}", now + i)
            for i, body in enumerate(bodies)]


def _chunk(token_ids: list[int], finish: str | None = None) -> dict:
    return {"request_id": "generate-tokens-r", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": token_ids, "finish_reason": finish}]}


def _record(responses) -> RequestRecord:
    return RequestRecord(responses=responses, start_perf_ns=time.perf_counter_ns() - 1_000)


def test_aiperf_finds_the_endpoint_through_titos_entry_point():
    assert plugins.get_class(PluginType.ENDPOINT, "vllm_generate") is VllmGenerateEndpoint
    metadata = plugins.get_endpoint_metadata("vllm_generate")
    assert metadata.endpoint_path == "/inference/v1/generate"
    assert metadata.supports_streaming and metadata.produces_tokens and metadata.tokenizes_input


def test_the_prompt_goes_as_the_tokenizers_ids_and_the_extra_inputs_where_vllm_reads_them(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, ignore_eos=True, min_tokens=16, cache_salt="salt-1")
    payload = _payload(endpoint)
    ids = Tokenizer.from_file(str(tiny_text_model / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    assert payload == {"token_ids": ids, "model": "served", "stream": False, "cache_salt": "salt-1",
                       "sampling_params": {"max_tokens": 16, "ignore_eos": True, "min_tokens": 16}}
    try:
        from vllm.entrypoints.scale_out.token_in_token_out import protocol
    except ImportError:
        return
    request = protocol.GenerateRequest.model_validate(payload)  # vLLM's own model takes it whole
    assert request.sampling_params.ignore_eos and request.sampling_params.min_tokens == 16


def test_a_turns_extra_body_and_a_sampling_params_object_are_merged_in(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, sampling_params={"temperature": 0.0}, max_tokens=4)
    payload = _payload(endpoint, max_tokens=None, seed=7, request_id="mine")
    assert payload["sampling_params"] == {"temperature": 0.0, "max_tokens": 4, "seed": 7}
    assert payload["request_id"] == "mine" and "tokenizer" not in payload


def test_a_stream_asks_for_usage_unless_told(tiny_text_model):
    assert _payload(_endpoint(tiny_text_model, streaming=True))["stream_options"] == {"include_usage": True}
    told = _endpoint(tiny_text_model, streaming=True, stream_options={"include_usage": False})
    assert _payload(told)["stream_options"] == {"include_usage": False}


def test_a_streams_count_is_the_token_ids_received(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, streaming=True)
    parsed = endpoint.extract_response_data(_record(_sse(
        _chunk([11, 12]), _chunk([13]), _chunk([14], "length"),
        {"request_id": "generate-tokens-r", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}, "[DONE]")))
    assert [response.data is not None for response in parsed] == [True, True, True, False]
    assert parsed[-1].usage.completion_tokens == 4 and parsed[-1].usage.prompt_tokens == 7


def test_without_the_servers_usage_the_count_is_still_the_ids(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, streaming=True)
    parsed = endpoint.extract_response_data(_record(_sse(_chunk([11, 12]), _chunk([13], "length"), "[DONE]")))
    assert parsed[-1].usage.completion_tokens == 3 and parsed[-1].usage.prompt_tokens is None


def test_a_whole_answers_ids_are_decoded_for_client_side_counting(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, server_counts=False)
    ids = Tokenizer.from_file(str(tiny_text_model / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    body = {"request_id": "generate-tokens-r", "model": "served", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}}
    (parsed,) = endpoint.extract_response_data(_record([TextResponse(time.perf_counter_ns(), json.dumps(body))]))
    assert parsed.data.get_text() == PROMPT and parsed.usage.completion_tokens == len(ids)


def test_an_error_in_a_stream_fails_the_request(tiny_text_model):
    endpoint = _endpoint(tiny_text_model, streaming=True)
    error = {"error": {"message": "token_ids[0]: out of vocabulary", "type": "BadRequestError", "code": 400}}
    with pytest.raises(GenerateError, match="out of vocabulary"):
        endpoint.extract_response_data(_record(_sse(_chunk([11]), error, "[DONE]")))


def test_the_input_length_is_the_ids_sent(tiny_text_model):
    endpoint = _endpoint(tiny_text_model)
    assert endpoint.extract_payload_inputs(_payload(endpoint)).pretokenised_token_count == \
        len(_payload(endpoint)["token_ids"])
