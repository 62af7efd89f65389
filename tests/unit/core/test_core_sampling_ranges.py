"""One table of sampling ranges (tito.contract.SAMPLING_RANGES): render and engine refuse the same
out-of-range value with the same reason and the same description, under their own field paths."""

import math

import pytest

from tito.contract import INVALID_SAMPLING_PARAMS, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS, SAMPLING_RANGES
from tito.errors import InvalidArgument
from tito.v1 import render_pb2
from tito_engine.request import RawSamplingParams
from tito_engine.backend.validation import ModelLimits, resolve_sampling as engine_resolve
from tito_render.convert import sampling_options_from_proto
from tito_render.sampling import SamplingLimits, resolve_sampling


def render_resolve(options: render_pb2.SamplingOptions, limits: SamplingLimits):
    """Render's resolution of `options`, converted as its servicer converts them."""
    return resolve_sampling(sampling_options_from_proto(options), limits)


BAD_VALUES = [("temperature", -0.5), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5),
              ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
              ("frequency_penalty", -math.inf), ("top_logprobs", MAX_TOP_LOGPROBS + 1)]


def _render_refusal(name, value):
    options = render_pb2.SamplingOptions(logprobs=True, **{name: value})
    with pytest.raises(InvalidArgument) as caught:
        render_resolve(options, SamplingLimits(prompt_tokens=4, max_context_length=64, vocab_size=100))
    return caught.value


def _engine_refusal(name, value):
    with pytest.raises(InvalidArgument) as caught:
        engine_resolve(RawSamplingParams(logprobs=True, **{name: value}), 4, ModelLimits(vocab_size=100,
                                                                                         max_context_length=64))
    return caught.value


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_render_and_engine_refuse_the_same_value_the_same_way(name, value):
    render, engine = _render_refusal(name, value), _engine_refusal(name, value)
    assert render.reason == engine.reason == INVALID_SAMPLING_PARAMS
    assert [v.field for v in render.violations] == [f"sampling.{name}"]
    assert [v.field for v in engine.violations] == [f"sampling_params.{name}"]
    assert render.violations[0].description == engine.violations[0].description
    assert SAMPLING_RANGES[name].expectation in engine.violations[0].description


def test_top_logprobs_needs_logprobs_in_both():
    render = pytest.raises(InvalidArgument, render_resolve, render_pb2.SamplingOptions(top_logprobs=2),
                           SamplingLimits(prompt_tokens=4, max_context_length=64, vocab_size=100)).value
    engine = pytest.raises(InvalidArgument, engine_resolve, RawSamplingParams(top_logprobs=2), 4,
                           ModelLimits(vocab_size=100, max_context_length=64)).value
    assert render.violations[0].description == engine.violations[0].description == "top_logprobs needs logprobs=true"


@pytest.mark.parametrize("name,value", [("temperature", 0.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
                                        ("repetition_penalty", 1.0), ("presence_penalty", -2.0),
                                        ("top_logprobs", MAX_TOP_LOGPROBS)])
def test_edges_of_each_range_pass_in_both(name, value):
    render_resolve(render_pb2.SamplingOptions(logprobs=True, **{name: value}),
                   SamplingLimits(prompt_tokens=4, max_context_length=64, vocab_size=100))
    engine_resolve(RawSamplingParams(logprobs=True, **{name: value}), 4, ModelLimits(vocab_size=100,
                                                                                     max_context_length=64))


@pytest.mark.parametrize("bias, entry", [
    ({3: 100.5}, "[3]"), ({3: -101.0}, "[3]"), ({3: -1e6}, "[3]"), ({3: math.nan}, "[3]"), ({3: math.inf}, "[3]"),
    ({3: -math.inf}, "[3]"), ({5: 1.0, 100: 1.0}, "[100]"), ({7: 1.0, 100: 200.0, 3: 200.0}, "[3]"),
    (dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 0.0), ""),
])
def test_render_and_engine_refuse_the_same_logit_bias_the_same_way(bias, entry):
    limits = SamplingLimits(prompt_tokens=4, max_context_length=64, vocab_size=100)
    render = pytest.raises(InvalidArgument, render_resolve, render_pb2.SamplingOptions(logit_bias=bias), limits).value
    engine = pytest.raises(InvalidArgument, engine_resolve, RawSamplingParams(logit_bias=bias), 4,
                           ModelLimits(vocab_size=100, max_context_length=64)).value
    assert render.reason == engine.reason == INVALID_SAMPLING_PARAMS
    assert [v.field for v in render.violations] == [f"sampling.logit_bias{entry}"]
    assert [v.field for v in engine.violations] == [f"sampling_params.logit_bias{entry}"]
    assert render.violations[0].description == engine.violations[0].description


def test_the_edges_of_logit_bias_are_accepted_by_both():
    vocab = 4 * MAX_LOGIT_BIAS_ENTRIES
    bias = {0: -100.0, vocab - 1: 100.0, **dict.fromkeys(range(1, MAX_LOGIT_BIAS_ENTRIES - 1), 0.5)}
    render = render_resolve(render_pb2.SamplingOptions(logit_bias=bias),
                            SamplingLimits(prompt_tokens=4, max_context_length=64, vocab_size=vocab))
    engine = engine_resolve(RawSamplingParams(logit_bias=bias), 4, ModelLimits(vocab_size=vocab, max_context_length=64))
    assert dict(render.logit_bias) == engine.logit_bias.as_dict() == bias
