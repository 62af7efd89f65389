"""Admitted requests as vLLM inputs: media items, identifiers, the multimodal cache, outputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tito import tensors
from tito.errors import FailedPrecondition
from tito.v1 import multimodal_pb2
from tito_engine.multimodal.features import CheckedItem, content_digest
from tito_engine.multimodal.specs import ItemLayout
from tito_engine.request import FinishReason, LogitBias, SamplingOptions
from tito_engine.service.convert import item_from_proto
from tito_engine.vllm.inputs import (MediaConverter, OutputConverter, item_hf_inputs, sampling_params,
                                     with_kv_transfer_params)

pytestmark = pytest.mark.vllm

HASH = "ab" * 16


def checked(index: int, *, kwargs: bool = True, trusted: bool = True, is_embed=()) -> CheckedItem:
    item = multimodal_pb2.MultiModalItem(modality=multimodal_pb2.MODALITY_IMAGE, mm_hash=HASH[:-1] + str(index),
                                         placeholder=multimodal_pb2.PlaceholderRange(offset=2 + 10 * index, length=4,
                                                                                     is_embed=is_embed))
    item.metadata["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array([1, 4, 4], dtype=np.int64)))
    if kwargs:
        item.kwargs["pixel_values"].CopyFrom(tensors.from_numpy(np.full((16, 8), index, dtype=np.float32)))
        item.kwargs["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array([1, 4, 4], dtype=np.int64)))
    return CheckedItem(item_from_proto(item), f"mm_features.items[{index}]", "image", ItemLayout(4, (1, 4, 4)), (),
                       False, trusted)


class FakeCache:
    """vLLM's front-end multimodal cache: which identifiers its engine core holds."""

    def __init__(self, held=()):
        self.held = set(held)

    def is_cached_item(self, identifier):
        return identifier in self.held

    def get_and_update_item(self, entry, identifier):
        data, updates = entry
        if identifier in self.held:
            return None, updates
        self.held.add(identifier)
        return data, updates


def converter(cache):
    return MediaConverter(lambda item: ("built", item.item.mm_hash), cache)


def test_items_keep_their_hash_placeholders_and_is_embed_masks():
    items = [checked(0), checked(1, is_embed=[False, True, True, False])]
    kwargs, hashes, placeholders, hits, misses = converter(FakeCache()).convert(items)
    assert hashes == {"image": [items[0].item.mm_hash, items[1].item.mm_hash]}
    assert kwargs["image"] == [("built", items[0].item.mm_hash), ("built", items[1].item.mm_hash)]
    assert [(p.offset, p.length) for p in placeholders["image"]] == [(2, 4), (12, 4)]
    assert placeholders["image"][0].is_embed is None
    assert placeholders["image"][1].is_embed.tolist() == [False, True, True, False]
    assert (hits, misses) == (0, 2)


def test_an_unsigned_item_is_keyed_by_its_tensors_not_its_claimed_hash():
    item = checked(0, trusted=False)
    _, hashes, _, _, _ = converter(FakeCache()).convert([item])
    assert hashes["image"] == [content_digest(item.item)]


def test_metadata_only_items_need_vllm_to_hold_them():
    held = checked(0, kwargs=False)
    kwargs, _, _, hits, misses = converter(FakeCache({held.item.mm_hash})).convert([held])
    assert kwargs["image"] == [None] and (hits, misses) == (1, 0)  # vLLM's engine core fills it in
    with pytest.raises(FailedPrecondition) as exc:
        converter(FakeCache()).convert([held])
    assert (exc.value.reason, exc.value.violations[0].field) == ("MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs")
    with pytest.raises(FailedPrecondition, match="unsigned"):  # an untrusted hash cannot claim a cache hit
        converter(FakeCache({held.item.mm_hash})).convert([checked(0, kwargs=False, trusted=False)])


def test_items_vllm_already_holds_are_not_sent_again():
    item = checked(0)
    cache = FakeCache({item.item.mm_hash})
    kwargs, _, _, hits, _ = converter(cache).convert([item])
    assert kwargs["image"] == [None] and hits == 1


def test_hf_inputs_batch_one_item_with_kwargs_over_metadata():
    inputs = item_hf_inputs(checked(1))
    assert inputs["pixel_values"].shape == (16, 8) and inputs["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_sampling_params_keep_the_contract():
    options = SamplingOptions(max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=0, min_p=0.1, seed=5,
                              stop_token_ids=frozenset({7}), n=2, presence_penalty=0.5, frequency_penalty=-0.5,
                              repetition_penalty=1.1, logprobs=True, top_logprobs=3)
    params = sampling_params(options, eos_token_ids=(1002, 1000))
    assert (params.n, params.max_tokens, params.min_tokens, params.seed, params.logprobs) == (2, 9, 2, 5, 3)
    assert (params.temperature, params.top_p, params.min_p) == pytest.approx((0.7, 0.9, 0.1))
    assert sorted(params.stop_token_ids) == [7, 1000, 1002] and not params.ignore_eos
    assert params.detokenize is False
    ignoring = sampling_params(SamplingOptions(max_tokens=4, ignore_eos=True, stop_token_ids=frozenset({7})), (1002,))
    assert ignoring.stop_token_ids == [7] and ignoring.ignore_eos
    greedy = sampling_params(SamplingOptions(max_tokens=4, temperature=0.0, n=3), (1002,))
    assert greedy.n == 1  # vLLM refuses greedy n > 1; the converter replicates the one choice


def _completion(index, token_ids, finish=None, logprobs=None):
    return SimpleNamespace(index=index, token_ids=token_ids, finish_reason=finish, logprobs=logprobs)


def test_outputs_become_choice_outputs_with_usage_and_matched_stop():
    converter_ = OutputConverter(SamplingOptions(max_tokens=4, temperature=0.0, n=2), prompt_tokens=5)
    first = converter_.convert(SimpleNamespace(outputs=[_completion(0, [11, 12])], num_cached_tokens=3))
    assert [(c.index, c.token_ids) for c in first] == [(0, (11, 12)), (1, (11, 12))]
    last = converter_.convert(SimpleNamespace(outputs=[_completion(0, [1002], "stop")], num_cached_tokens=3))
    assert all(c.finish_reason is FinishReason.STOP and c.matched_stop_token_id == 1002 for c in last)
    assert [c.usage.completion_tokens for c in last] == [3, 3] and last[0].usage.cached_tokens == 3
    aborted = OutputConverter(SamplingOptions(max_tokens=4), 5).convert(
        SimpleNamespace(outputs=[_completion(0, [], "abort")], num_cached_tokens=0))
    assert aborted[0].finish_reason is FinishReason.ABORT and aborted[0].matched_stop_token_id is None


def test_kv_transfer_params_go_where_vllms_servers_put_them_and_the_answer_comes_back():
    params = with_kv_transfer_params(sampling_params(SamplingOptions(max_tokens=1), (1002,)),
                                     {"do_remote_decode": True})
    assert params.extra_args == {"kv_transfer_params": {"do_remote_decode": True}}
    assert with_kv_transfer_params(sampling_params(SamplingOptions(max_tokens=1), (1002,)), None).extra_args is None
    converter_ = OutputConverter(SamplingOptions(max_tokens=1), prompt_tokens=5)
    answer = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    (last,) = converter_.convert(SimpleNamespace(outputs=[_completion(0, [9], "length")], num_cached_tokens=0,
                                                 kv_transfer_params=answer))
    assert last.kv_connector_params == answer
    (plain,) = OutputConverter(SamplingOptions(max_tokens=1), 5).convert(
        SimpleNamespace(outputs=[_completion(0, [9], "length")], num_cached_tokens=0))
    assert plain.kv_connector_params is None
    replicated = OutputConverter(SamplingOptions(max_tokens=1, temperature=0.0, n=2), 5).convert(
        SimpleNamespace(outputs=[_completion(0, [9], "length")], num_cached_tokens=0, kv_transfer_params=answer))
    assert [choice.kv_connector_params for choice in replicated] == [answer, None]  # once, on choice 0


def test_logprobs_keep_the_top_by_rank_and_the_sampled_token():
    entry = lambda logprob, rank: SimpleNamespace(logprob=logprob, rank=rank)  # noqa: E731
    positions = [{5: entry(-2.0, 3), 8: entry(-0.5, 1), 9: entry(-1.0, 2)}]
    converter_ = OutputConverter(SamplingOptions(max_tokens=4, logprobs=True, top_logprobs=2), 1)
    (choice,) = converter_.convert(SimpleNamespace(outputs=[_completion(0, [5], None, positions)],
                                                   num_cached_tokens=0))
    (position,) = choice.logprobs
    assert (position.sampled.token_id, position.sampled.rank) == (5, 3)
    assert [(t.token_id, t.rank) for t in position.top] == [(8, 1), (9, 2)]


def test_a_constraint_goes_to_vllm_as_the_grammar_the_native_engine_compiles():
    from tito.structured_output import StructuredOutputSpec, grammar_of

    spec = StructuredOutputSpec("json_schema",
                                '{"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}')
    params = sampling_params(SamplingOptions(max_tokens=4, structured_output=spec), (1002,))
    assert params.structured_outputs.grammar == str(grammar_of(spec))
    assert "\\0-\\x1f" in params.structured_outputs.grammar  # control characters stay out of bounded strings
    assert sampling_params(SamplingOptions(max_tokens=4), (1002,)).structured_outputs is None


def test_a_migrated_choice_under_a_constraint_is_refused_by_vllm():
    """vLLM would start the grammar after the earlier output, which it reads as prompt."""
    from tito.structured_output import StructuredOutputSpec

    spec = StructuredOutputSpec("regex", "[a-z]+")
    with pytest.raises(FailedPrecondition) as refused:
        sampling_params(SamplingOptions(max_tokens=4, structured_output=spec, prior_output_tokens=2), (1002,))
    assert refused.value.field == "sampling_params.prior_output_tokens"
    assert sampling_params(SamplingOptions(max_tokens=4, prior_output_tokens=2), (1002,)).max_tokens == 4


def test_logit_bias_goes_to_vllm_as_its_token_id_to_bias_dict():
    bias = LogitBias((3, 50), (-100.0, 2.5))
    assert sampling_params(SamplingOptions(max_tokens=4, logit_bias=bias), (1002,)).logit_bias == {3: -100.0, 50: 2.5}
    assert sampling_params(SamplingOptions(max_tokens=4), (1002,)).logit_bias is None
