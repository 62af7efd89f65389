import pytest

from tito.errors import InvalidArgument
from tito.structured_output import StructuredOutputSpec
from tito_engine.request import GenerateInput, LogitBias, RawSamplingParams
from tito_engine.backend.validation import ModelLimits, validate_generate

LIMITS = ModelLimits(vocab_size=100, max_context_length=32, max_choices=4)


def check(token_ids=(1, 2, 3), modalities=(), **sampling):
    return validate_generate(GenerateInput("r", list(token_ids), RawSamplingParams(**sampling), list(modalities)),
                             LIMITS)


def field_of(exc_info) -> str:
    return exc_info.value.field


def test_defaults_are_resolved():
    options = check()
    assert options.max_tokens == 29  # up to the context limit
    assert options.temperature == 1.0 and options.top_p == 1.0 and options.n == 1
    assert not options.greedy
    assert check(temperature=0.0).greedy
    assert check(top_k=-1).top_k == 0


@pytest.mark.parametrize("token_ids, field", [((), "token_ids"), ((1, 100), "token_ids[1]"),
                                              ((5, 7, 1000), "token_ids[2]"), ((1,) * 32, "token_ids")])
def test_prompt_errors_name_the_field(token_ids, field):
    with pytest.raises(InvalidArgument) as exc:
        check(token_ids)
    assert field_of(exc) == field


@pytest.mark.parametrize("sampling, field", [
    ({"max_tokens": 30}, "sampling_params.max_tokens"),
    ({"max_tokens": 0}, "sampling_params.max_tokens"),
    ({"temperature": -0.1}, "sampling_params.temperature"),
    ({"temperature": float("nan")}, "sampling_params.temperature"),
    ({"top_p": 0.0}, "sampling_params.top_p"),
    ({"top_p": 1.5}, "sampling_params.top_p"),
    ({"min_p": 1.5}, "sampling_params.min_p"),
    ({"top_k": -2}, "sampling_params.top_k"),
    ({"n": 0}, "sampling_params.n"),
    ({"n": 5}, "sampling_params.n"),
    ({"top_logprobs": 21}, "sampling_params.top_logprobs"),
    ({"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
    ({"presence_penalty": 3.0}, "sampling_params.presence_penalty"),
    ({"stop_token_ids": (5, 100)}, "sampling_params.stop_token_ids[1]"),
    ({"max_tokens": 4, "min_tokens": 5}, "sampling_params.min_tokens"),
    ({"logit_bias": {5: 1.0, 100: -1.0}}, "sampling_params.logit_bias[100]"),  # more: test_core_sampling_ranges.py
    ({"prior_output_tokens": 3}, "sampling_params.prior_output_tokens"),  # the whole prompt is output
    ({"prior_output_tokens": 1, "n": 2}, "sampling_params.prior_output_tokens"),  # continues one choice
])
def test_sampling_errors_name_the_field(sampling, field):
    with pytest.raises(InvalidArgument) as exc:
        check(**sampling)
    assert field_of(exc) == field
    assert exc.value.reason == "INVALID_SAMPLING_PARAMS"


def test_a_continued_choice_keeps_its_prior_output_count():
    assert check(prior_output_tokens=2, max_tokens=5).prior_output_tokens == 2
    assert check().prior_output_tokens == 0
    # A constrained choice continues too: the engine core advances its grammar over those ids.
    spec = StructuredOutputSpec("regex", "[a-z]+")
    assert check(prior_output_tokens=1, structured_output=spec).prior_output_tokens == 1


def test_max_tokens_exactly_filling_the_context_is_accepted():
    assert check(max_tokens=29).max_tokens == 29


def test_media_on_text_model_names_the_item():
    with pytest.raises(InvalidArgument) as exc:
        check(modalities=["image"])
    assert field_of(exc) == "mm_features.items[0].modality"


def test_penalties_and_logprobs_are_resolved():
    options = check(logprobs=True, top_logprobs=5, frequency_penalty=0.5, presence_penalty=-1.0,
                    repetition_penalty=1.1)
    assert options.logprobs and options.top_logprobs == 5 and options.wants_logprobs
    assert (options.frequency_penalty, options.presence_penalty, options.repetition_penalty) == (0.5, -1.0,
                                                                                                  pytest.approx(1.1))
    assert options.has_penalties and not options.plain_greedy
    assert check(temperature=0.0).plain_greedy and not check(temperature=0.0, min_tokens=1).plain_greedy


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidArgument) as exc:
        check(top_logprobs=2)
    assert field_of(exc) == "sampling_params.top_logprobs"


def test_logit_bias_is_resolved_in_id_order_and_leaves_the_greedy_fast_path():
    options = check(temperature=0.0, logit_bias={42: -100.0, 0: 100, 99: 0.5})
    assert options.logit_bias == LogitBias((0, 42, 99), (100.0, -100.0, 0.5))
    assert options.greedy and not options.plain_greedy  # argmax of the raw logits no longer decides
    assert check(temperature=0.0, logit_bias={}).logit_bias is None and check(temperature=0.0).plain_greedy


def test_logit_bias_refusal_is_one_violation_however_many_entries_are_wrong():
    with pytest.raises(InvalidArgument) as exc:
        check(logit_bias={**dict.fromkeys(range(100, 1100), 1.0), 3: 200.0})
    assert [v.field for v in exc.value.violations] == ["sampling_params.logit_bias[3]"]
    assert "1000 more entries are wrong too" in exc.value.violations[0].description
