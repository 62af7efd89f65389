"""Sampling resolution: request value, else generation config, else tito default; ranges named."""

from __future__ import annotations

import pytest

from tito.contract import INVALID_SAMPLING_PARAMS
from tito.errors import InvalidArgument
from tito.v1 import render_pb2, sampling_pb2
from tito_render.convert import sampling_options_from_proto, sampling_to_proto
from tito_render.domain import SamplingOptions
from tito_render.sampling import SamplingLimits, resolve_sampling

LIMITS = SamplingLimits(prompt_tokens=10, max_context_length=100, vocab_size=1000)


def options(**fields) -> SamplingOptions:
    """The options as the servicer hands them to the domain (through the wire message: float32 values)."""
    stop = fields.pop("stop", [])
    stop_ids = fields.pop("stop_token_ids", [])
    return sampling_options_from_proto(render_pb2.SamplingOptions(stop=stop, stop_token_ids=stop_ids, **fields))


def test_tito_defaults_and_context_remainder():
    params = resolve_sampling(options(), LIMITS)
    assert params.max_tokens == 90
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.repetition_penalty == 1.0 and params.n == 1
    assert params.seed is None
    assert params.text_options.skip_special_tokens and not params.text_options.spaces_between_special_tokens


def test_generation_config_defaults_then_request_wins():
    limits = SamplingLimits(10, 100, 1000, generation_defaults={
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 32})
    params = resolve_sampling(options(), limits)
    assert params.temperature == pytest.approx(0.6) and params.top_p == pytest.approx(0.95)
    assert params.top_k == 20 and params.repetition_penalty == pytest.approx(1.1)
    assert params.max_tokens == 32
    params = resolve_sampling(options(temperature=0.0, top_k=-1, max_tokens=50, seed=7), limits)
    assert params.temperature == 0.0 and params.top_k == 0 and params.max_tokens == 50 and params.seed == 7


def test_generation_max_new_tokens_capped_by_remainder():
    limits = SamplingLimits(95, 100, 1000, generation_defaults={"max_new_tokens": 32})
    assert resolve_sampling(options(), limits).max_tokens == 5


def test_stop_strings_go_to_text_options_and_stop_ids_to_params():
    params = resolve_sampling(options(stop=["\n\n", "END"], stop_token_ids=[3, 4],
                                      include_stop_str_in_output=True, skip_special_tokens=False), LIMITS)
    assert list(params.text_options.stop) == ["\n\n", "END"]
    assert params.text_options.include_stop_str_in_output and not params.text_options.skip_special_tokens
    assert list(params.stop_token_ids) == [3, 4]


@pytest.mark.parametrize("fields, field", [
    ({"temperature": -0.5}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -2}, "sampling.top_k"),
    ({"min_p": 1.5}, "sampling.min_p"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
    ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"max_tokens": 91}, "sampling.max_tokens"),
    ({"max_tokens": 5, "min_tokens": 6}, "sampling.min_tokens"),
    ({"n": 0}, "sampling.n"),
    ({"top_logprobs": 21, "logprobs": True}, "sampling.top_logprobs"),
    ({"top_logprobs": 2}, "sampling.top_logprobs"),
    ({"stop": ["x"] * 17}, "sampling.stop"),
    ({"stop": ["ok", ""]}, "sampling.stop[1]"),
    ({"stop": ["ok", "x" * 1025]}, "sampling.stop[1]"),  # derender's bound too (tito.contract)
    ({"stop_token_ids": [1, 1000]}, "sampling.stop_token_ids[1]"),
    ({"logit_bias": {1: 5.0, 1000: -5.0}}, "sampling.logit_bias[1000]"),  # more: test_core_sampling_ranges.py
])
def test_range_errors_name_the_field(fields, field):
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(options(**fields), LIMITS)
    assert err.value.field == field
    assert err.value.reason == INVALID_SAMPLING_PARAMS


def test_logit_bias_reaches_the_generate_request_whole():
    bias = {999: -100.0, 0: 100.0, 42: 0.25}
    params = resolve_sampling(options(logit_bias=bias), LIMITS)
    assert params.logit_bias == ((0, 100.0), (42, 0.25), (999, -100.0))
    wire = sampling_pb2.SamplingParams()
    sampling_to_proto(params, wire)
    assert dict(wire.logit_bias) == bias
    assert resolve_sampling(options(), LIMITS).logit_bias == ()


def test_max_tokens_at_remainder_is_accepted():
    assert resolve_sampling(options(max_tokens=90), LIMITS).max_tokens == 90


@pytest.mark.parametrize("prompt_tokens", [100, 150])
def test_prompt_filling_the_context_is_rejected(prompt_tokens):
    with pytest.raises(InvalidArgument) as err:
        resolve_sampling(options(), SamplingLimits(prompt_tokens, 100, 1000, prompt_field="prompt"))
    assert err.value.field == "prompt"
    assert f"prompt is {prompt_tokens} tokens, context limit 100" in err.value.message
