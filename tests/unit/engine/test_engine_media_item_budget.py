"""The largest media item an engine admits (Admission.largest_media_item, SMG's
`mm_encoder_budget`): bounded by the context limit or by the whole KV cache, whichever is
smaller, with room for one generated token, and by the backend's own bound where it has one
(vLLM's encoder budget); 0 for a model without media. The number is the admission's own: a
prompt that long is admitted, one token more is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tito.errors import InvalidArgument, ResourceExhausted
from tito_engine.backend.admission import Admission, KVCapacity
from tito_engine.backend.validation import ModelLimits
from tito_engine.multimodal.items import FeaturePolicy
from tito_engine.request import GenerateInput, RawSamplingParams

VOCAB = 100


def _admission(context: int, kv_blocks: int, block_size: int = 16, modalities=("image",),
               backend_limit: int | None = None) -> Admission:
    return Admission(ModelLimits(vocab_size=VOCAB, max_context_length=context, modalities=frozenset(modalities)),
                     None, FeaturePolicy(), KVCapacity(blocks_total=kv_blocks, block_size=block_size),
                     media_item_rows_limit=backend_limit)


def _admit(admission: Admission, prompt_len: int) -> None:
    admission.admit(GenerateInput("r", [1] * prompt_len, RawSamplingParams(max_tokens=1)))


@pytest.mark.parametrize(("context", "kv_blocks", "expected", "refusal"), [
    (512, 64, 511, InvalidArgument),  # the context limit binds (the KV cache holds 1,024 tokens)
    (512, 16, 255, ResourceExhausted),  # the KV cache binds (256 tokens)
])
def test_the_largest_item_is_the_longest_prompt_admission_takes(context, kv_blocks, expected, refusal):
    admission = _admission(context, kv_blocks)
    assert admission.largest_media_item() == expected
    _admit(admission, expected)  # a prompt that is all one item's rows, plus one token to generate
    with pytest.raises(refusal):
        _admit(admission, expected + 1)


def test_a_model_without_media_has_no_item_budget():
    assert _admission(512, 64, modalities=()).largest_media_item() == 0


def test_a_backends_own_bound_lowers_it_and_admission_takes_it_from_the_backend():
    assert _admission(512, 64, backend_limit=300).largest_media_item() == 300
    assert _admission(512, 64, backend_limit=4096).largest_media_item() == 511  # the context still binds
    backend = SimpleNamespace(info=SimpleNamespace(vocab_size=VOCAB, max_context_length=512, modalities=("image",)),
                              mm_spec=None, max_running_sequences=4, kv_capacity=KVCapacity(64, 16),
                              media_item_rows_limit=200)
    assert Admission.for_backend(backend).largest_media_item() == 200
