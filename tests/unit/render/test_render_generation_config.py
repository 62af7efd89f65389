"""generation_config.json defaults, field by field: the request's value wins, the model's default
fills an unset field, tito's default fills the rest; `do_sample: false` means greedy unless the
request asks for sampling; out-of-range model values are ignored, never fail a request."""

from __future__ import annotations

import json
import logging

import pytest

from tito.v1 import render_pb2
from tito_render.convert import sampling_options_from_proto
from tito_render.model import generation_defaults
from tito_render.sampling import SamplingLimits, resolve_sampling


def resolve(generation_config: dict, prompt_tokens: int = 10, **request):
    limits = SamplingLimits(prompt_tokens=prompt_tokens, max_context_length=100, vocab_size=1000,
                            generation_defaults=generation_defaults(generation_config))
    return resolve_sampling(sampling_options_from_proto(render_pb2.SamplingOptions(**request)), limits)


# (generation_config.json field, its value, the SamplingParams field, tito's default, a request value)
FIELDS = [
    ("temperature", 0.6, "temperature", 1.0, 0.3),
    ("top_p", 0.8, "top_p", 1.0, 0.5),
    ("top_k", 20, "top_k", 0, 5),
    ("min_p", 0.05, "min_p", 0.0, 0.2),
    ("repetition_penalty", 1.05, "repetition_penalty", 1.0, 1.3),
    ("presence_penalty", 0.5, "presence_penalty", 0.0, -0.5),
    ("frequency_penalty", 0.25, "frequency_penalty", 0.0, 1.0),
    ("max_new_tokens", 32, "max_tokens", 90, 7),
]


@pytest.mark.parametrize("key,model_value,param,tito_default,request_value", FIELDS, ids=[f[0] for f in FIELDS])
def test_each_field_request_then_model_then_tito(key, model_value, param, tito_default, request_value):
    request_field = "max_tokens" if key == "max_new_tokens" else key
    assert getattr(resolve({}), param) == pytest.approx(tito_default)
    assert getattr(resolve({key: model_value}), param) == pytest.approx(model_value)
    assert getattr(resolve({key: model_value}, **{request_field: request_value}), param) == pytest.approx(request_value)


@pytest.mark.parametrize("key,bad", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", 2),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -3), ("max_new_tokens", 0),
    ("temperature", "hot"), ("top_k", True), ("max_new_tokens", 1.5)])
def test_out_of_range_model_values_are_ignored_with_a_warning(key, bad, caplog):
    with caplog.at_level(logging.WARNING, logger="tito_render.model"):
        assert key not in generation_defaults({key: bad})
    assert f"ignoring {key}=" in caplog.text
    resolve({key: bad})  # the request does not fail on a field it never set


def test_max_new_tokens_is_capped_by_the_context_remainder():
    assert resolve({"max_new_tokens": 32}, prompt_tokens=95).max_tokens == 5


# (generation config, request, resolved temperature)
DO_SAMPLE = [
    ({"do_sample": False}, {}, 0.0),                             # HF: greedy
    ({"do_sample": False, "temperature": 0.7}, {}, 0.0),         # HF ignores temperature then
    ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.9}, 0.9),  # the request wins
    ({"do_sample": False}, {"temperature": 0.0}, 0.0),
    ({"do_sample": False, "temperature": 0.7}, {"top_p": 0.9}, 0.7),  # asks for sampling
    ({"do_sample": False}, {"top_k": 40}, 1.0),
    ({"do_sample": False}, {"min_p": 0.1}, 1.0),
    ({"do_sample": False}, {"seed": 3}, 0.0),                     # a seed alone does not
    ({"do_sample": True, "temperature": 0.7}, {}, 0.7),
    ({"do_sample": True}, {}, 1.0),
    ({"temperature": 0.7}, {}, 0.7),                              # no do_sample: sample (as vLLM)
    ({"do_sample": "false"}, {}, 1.0),                            # not a boolean: not read
]


@pytest.mark.parametrize("generation_config,request_fields,temperature", DO_SAMPLE,
                         ids=[json.dumps([g, r]) for g, r, _ in DO_SAMPLE])
def test_do_sample_false_means_greedy_unless_the_request_samples(generation_config, request_fields, temperature):
    assert resolve(generation_config, **request_fields).temperature == pytest.approx(temperature)


def test_do_sample_false_keeps_the_other_model_defaults():
    params = resolve({"do_sample": False, "top_p": 0.8, "repetition_penalty": 1.1, "max_new_tokens": 12})
    assert params.temperature == 0.0 and params.top_p == pytest.approx(0.8)
    assert params.repetition_penalty == pytest.approx(1.1) and params.max_tokens == 12


def test_fields_tito_does_not_read_are_ignored():
    defaults = generation_defaults({"eos_token_id": [1, 2], "bos_token_id": 0, "pad_token_id": 0, "max_length": 20,
                                    "num_beams": 4, "typical_p": 0.5, "transformers_version": "4.51.0"})
    assert defaults == {}
    assert resolve({"max_length": 20}).max_tokens == 90  # the context remainder, not HF's max_length
