"""Admitted tito requests as vLLM inputs, and vLLM outputs as tito ChoiceOutputs.

Sampling keeps the contract's semantics (sampling.proto): every field maps one to one, EOS is the
model's EOS set as GetModelInfo reports it (generation_config.json and config.json, like the
native engine) unless ignore_eos, logprobs are the raw model distribution (vLLM's default
`raw_logprobs` mode) with 1-based ranks. Media items become vLLM's pre-processed multimodal input:
the kwargs tensors as the model's `MultiModalKwargsItem`s (vLLM's own field layout for the model),
the item's content id (its mm_hash when trusted) as the identifier vLLM's caches key on, and the
placeholder ranges with their `is_embed` masks. A metadata-only item is sent without tensors only
when vLLM's multimodal cache holds it; otherwise it is refused as the native engine refuses it.
A structured-output constraint becomes vLLM's `StructuredOutputsParams` (`structured_outputs`);
a migrated choice under one (prior_output_tokens) is refused: vLLM starts the grammar at the first
token it generates and cannot be told that the prompt's last ids are output under it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

from tito.errors import FailedPrecondition
from tito.structured_output import StructuredOutputSpec, grammar_of
from tito import tensors

from tito_engine.backend.admission import AdmittedRequest
from tito_engine.multimodal.features import TENSORS_REQUIRED, CheckedItem, content_digest
from tito_engine.request import (ChoiceOutput, FinishReason, PositionLogprobs, RequestTimings, SamplingOptions,
                                  TokenLogprob, Usage)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def sampling_params(options: SamplingOptions, eos_token_ids: Sequence[int]) -> Any:
    """vLLM SamplingParams with the contract's meaning of every tito field."""
    if options.prior_output_tokens and options.structured_output is not None:
        raise FailedPrecondition(
            "the vllm backend cannot continue a choice under structured_output (prior_output_tokens): vLLM starts "
            "the grammar at its first generated token; continue it on a native engine",
            reason="STRUCTURED_OUTPUT_UNAVAILABLE", field="sampling_params.prior_output_tokens")
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop_token_ids = set(options.stop_token_ids)
    if not options.ignore_eos:
        # The model's whole EOS set, as the native engine uses it (vLLM alone would take only the
        # tokenizer's EOS once its generation_config is pinned to "vllm").
        stop_token_ids.update(eos_token_ids)
    return SamplingParams(
        # vLLM refuses n > 1 at temperature 0; greedy choices are identical, so one is generated
        # and OutputConverter hands it out as every choice.
        n=1 if _replicated(options) else options.n,
        max_tokens=options.max_tokens,
        min_tokens=options.min_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,  # 0 disables in both
        min_p=options.min_p,
        seed=options.seed,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        stop_token_ids=sorted(stop_token_ids),
        ignore_eos=options.ignore_eos,
        logprobs=options.top_logprobs if options.logprobs else None,
        detokenize=False,  # derender owns the text
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_outputs(options.structured_output),
        # vLLM adds it before its penalties, as the native sampler does; admission checked it.
        logit_bias=options.logit_bias.as_dict() if options.logit_bias is not None else None,
    )


def structured_outputs(spec: StructuredOutputSpec | None) -> Any:
    """vLLM's StructuredOutputsParams for a tito constraint (None: unconstrained).

    Every kind goes to vLLM as the xgrammar EBNF grammar the native engine compiles
    (tito/structured_output.py), so both backends accept exactly the same outputs: the same
    compact JSON, the same escaped control characters, the same choice and tag grammars. vLLM's
    "auto" structured-output backend compiles EBNF with xgrammar.
    """
    if spec is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(grammar=_ebnf(spec))


@functools.lru_cache(maxsize=256)
def _ebnf(spec: StructuredOutputSpec) -> str:
    return str(grammar_of(spec))


def _replicated(options: SamplingOptions) -> bool:
    return options.temperature == 0.0 and options.n > 1


def _content_id(item: CheckedItem) -> str:
    """What vLLM's caches key the item on: the trusted mm_hash, else the engine's own digest of its
    tensors (an unsigned item can then only hit an entry for exactly the same encoder input)."""
    return item.item.mm_hash if item.trusted_hash else content_digest(item.item)


def item_hf_inputs(item: CheckedItem) -> dict[str, Any]:
    """The item's tensors (kwargs, then metadata for names kwargs lack) as torch tensors, one item
    batched the way HF processors return them (grids as [1, 3])."""
    merged: dict[str, Any] = {}
    for group in ("metadata", "kwargs"):  # kwargs win: they are what the encoder runs on
        for name, tensor in getattr(item.item, group).items():
            value = tensors.to_torch(tensor, f"{item.path}.{group}.{name}")
            if name.endswith("grid_thw") and value.dim() == 1:
                value = value[None]
            merged[name] = value
    return merged


def placeholder_range(item: CheckedItem) -> Any:
    import torch
    from vllm.multimodal.inputs import PlaceholderRange

    placeholder = item.item.placeholder
    is_embed = torch.tensor(placeholder.is_embed, dtype=torch.bool) if placeholder.is_embed else None
    return PlaceholderRange(offset=placeholder.offset, length=placeholder.length, is_embed=is_embed)


class MediaConverter:
    """Media items as vLLM's multimodal input for one model.

    `build_item(item)` makes the item's vLLM `MultiModalKwargsItem`; `cache` is vLLM's front-end
    multimodal processor cache (None when vLLM keeps none): it mirrors what vLLM's engine core holds.
    """

    def __init__(self, build_item: Callable[[CheckedItem], Any], cache: Any):
        self._build_item = build_item
        self._cache = cache

    @classmethod
    def for_llm(cls, llm: Any) -> "MediaConverter":
        """The converter of a running AsyncLLM: items laid out by the model's own vLLM processor."""
        from vllm.multimodal import MULTIMODAL_REGISTRY

        processor = MULTIMODAL_REGISTRY.create_processor(llm.vllm_config.model_config)
        return cls(cls.item_builder(processor), llm.renderer.mm_processor_cache)

    @staticmethod
    def item_builder(processor: Any) -> Callable[[CheckedItem], Any]:
        """An item's `MultiModalKwargsItem` in the field layout of a vLLM multimodal processor."""
        from transformers import BatchFeature
        from vllm.multimodal.inputs import MultiModalKwargsItems

        def build_item(item: CheckedItem) -> Any:
            hf_inputs = BatchFeature(item_hf_inputs(item))
            fields = processor._get_mm_fields_config(hf_inputs, {})
            return MultiModalKwargsItems.from_hf_inputs(hf_inputs, fields)[item.modality][0]

        return build_item

    def convert(self, items: Sequence[CheckedItem]) -> tuple[dict, dict, dict, int, int]:
        """(kwargs, hashes, placeholders) per modality, and the cache hits and misses."""
        kwargs: dict[str, list] = {}
        hashes: dict[str, list[str]] = {}
        placeholders: dict[str, list] = {}
        hits = misses = 0
        for item in items:
            identifier = _content_id(item) if (item.trusted_hash or item.item.kwargs) else None
            cached = self._cache is not None and identifier is not None and self._cache.is_cached_item(identifier)
            if item.item.kwargs:
                data = self._build_item(item)
                if self._cache is not None:
                    # Keeps vLLM's front-end shadow of its engine-side cache in step (and sends
                    # nothing twice): returns None when the engine already holds the item.
                    data, _ = self._cache.get_and_update_item((data, []), identifier)
            elif cached:
                data = None  # the engine core fills the item in from its cache
            else:
                why = ("it is unsigned, and this engine only lets signed items (or items with tensors) use its "
                       "cache") if not item.trusted_hash else "vLLM's multimodal cache does not hold it"
                raise FailedPrecondition(f"{item.path} has no kwargs (tensors) and {why}; re-render the request "
                                         f"with mm_payload TENSORS", reason=TENSORS_REQUIRED,
                                         field=f"{item.path}.kwargs")
            hits += cached
            misses += not cached
            kwargs.setdefault(item.modality, []).append(data)
            hashes.setdefault(item.modality, []).append(identifier)
            placeholders.setdefault(item.modality, []).append(placeholder_range(item))
        return kwargs, hashes, placeholders, hits, misses


def engine_input(request: AdmittedRequest, media: "MediaConverter | None") -> tuple[Any, int, int]:
    """vLLM's engine input for an admitted request, and its multimodal cache hits and misses."""
    from vllm.inputs.engine import mm_input, tokens_input
    from vllm.multimodal.inputs import MultiModalKwargsItems

    salt = request.cache_salt or None
    if not request.features:
        return tokens_input(list(request.token_ids), cache_salt=salt), 0, 0
    assert media is not None, "admission lets media through only for a multimodal model"
    kwargs, hashes, placeholders, hits, misses = media.convert(request.features.items)
    return mm_input(list(request.token_ids), MultiModalKwargsItems(kwargs), hashes, placeholders,
                    cache_salt=salt), hits, misses


def request_timings(stats: Any) -> RequestTimings | None:
    """tito's RequestTimings from vLLM's RequestStateStats (engine-core monotonic timestamps; 0
    means "not reached"); None when vLLM kept no statistics."""
    if stats is None or not stats.queued_ts:
        return None
    return RequestTimings(arrival=stats.queued_ts, scheduled=stats.scheduled_ts or None,
                          first_token=stats.first_token_ts or None,
                          finished=stats.last_token_ts or stats.first_token_ts or stats.queued_ts)


def _connector_answer(output: Any) -> dict | None:
    """vLLM's KV connector's answer (RequestOutput.kv_transfer_params, on the request's last
    output: a prefill's handoff for the decode engine), as a JSON-safe object."""
    answer = getattr(output, "kv_transfer_params", None)
    return json.loads(json.dumps(answer, default=str)) if answer else None


def _timings_if_finished(output: Any) -> RequestTimings | None:
    """The request's timings, on the outputs of its last RequestOutput only."""
    return request_timings(getattr(output, "metrics", None)) if getattr(output, "finished", False) else None


def with_kv_transfer_params(params: Any, kv_transfer_params: dict | None) -> Any:
    """`params` carrying vLLM's kv_transfer_params for its KV connector, where vLLM's own servers
    put them (SamplingParams.extra_args["kv_transfer_params"]; the scheduler's Request reads them
    there)."""
    if kv_transfer_params is not None:
        params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": dict(kv_transfer_params)}
    return params


class OutputConverter:
    """vLLM's delta RequestOutputs for one request as tito ChoiceOutputs."""

    def __init__(self, options: SamplingOptions, prompt_tokens: int):
        self._options = options
        self._prompt_tokens = prompt_tokens
        self._generated: dict[int, int] = {}  # choice -> tokens so far
        self._last_token: dict[int, int] = {}

    def convert(self, output: Any) -> list[ChoiceOutput]:
        choices = self._convert(output)
        if not _replicated(self._options):
            return choices
        # The connector's answer is the request's, reported once (choice 0), as the native engine does.
        return [dataclasses.replace(choice, index=index, kv_connector_params=choice.kv_connector_params if index == 0
                                    else None) for choice in choices for index in range(self._options.n)]

    def _convert(self, output: Any) -> list[ChoiceOutput]:
        choices = []
        for completion in output.outputs:
            index = completion.index
            token_ids = tuple(completion.token_ids)
            cached = (output.num_cached_tokens or 0) if token_ids and index not in self._generated else None
            if token_ids:
                self._generated[index] = self._generated.get(index, 0) + len(token_ids)
                self._last_token[index] = token_ids[-1]
            logprobs = self._logprobs(token_ids, completion.logprobs) if self._options.logprobs else ()
            finish = _FINISH.get(completion.finish_reason) if completion.finish_reason else None
            if completion.finish_reason and finish is None:
                finish = FinishReason.ABORT  # vLLM's "error" and any future reason: the choice did not complete
            if finish is None:
                choices.append(ChoiceOutput(index, token_ids, logprobs=logprobs, cached_tokens=cached))
                continue
            matched = self._last_token.get(index) if finish is FinishReason.STOP else None
            usage = Usage(self._prompt_tokens, self._generated.get(index, 0), output.num_cached_tokens or 0)
            choices.append(ChoiceOutput(index, token_ids, finish, matched, usage, logprobs,
                                        _timings_if_finished(output), cached,
                                        kv_connector_params=_connector_answer(output) if index == 0 else None))
        return choices

    def _logprobs(self, token_ids: tuple[int, ...], positions: Any) -> tuple[PositionLogprobs, ...]:
        if not positions:
            return ()
        top_k = self._options.top_logprobs
        result = []
        for token_id, entries in zip(token_ids, positions):
            entries = dict(entries)
            sampled = entries[token_id]
            top = sorted((entry.rank, candidate, entry.logprob) for candidate, entry in entries.items()
                         if entry.rank is not None and entry.rank <= top_k)
            result.append(PositionLogprobs(
                TokenLogprob(token_id, float(sampled.logprob), int(sampled.rank)),
                tuple(TokenLogprob(candidate, float(logprob), int(rank)) for rank, candidate, logprob in top[:top_k])))
        return tuple(result)
