"""Admission: every check a Generate or Encode request passes before it reaches a backend.

Both backends (the native engine and vLLM) sit behind this one path, so they refuse the same
requests with the same code, reason and field: token ids and the context limit, sampling ranges
(validation.py), the KV cache's capacity, and phase 1 of media admission (features.py: structure,
tensors, limits, HMAC signatures, model layout, placeholder tokens). What is left to a backend is
what only it can know: whether a metadata-only item is in its cache (FAILED_PRECONDITION
MM_TENSORS_REQUIRED either way), and its own queue limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tito import signing
from tito.errors import ResourceExhausted

from tito_engine.lora_types import check_lora_name, lora_disabled
from tito_engine.multimodal.domain import EncoderCacheDescriptor, MediaItem
from tito_engine.multimodal.features import (CheckedFeatures, FeaturePolicy, validate_encode_structure,
                                             validate_structure)

from tito_engine.multimodal.specs import ModelMultimodalSpec
from tito_engine.scheduling.blocks import blocks_for_tokens
from tito_engine.request import GenerateInput, SamplingOptions
from tito_engine.backend.validation import ModelLimits, validate_generate


@dataclass(frozen=True)
class KVCapacity:
    """The whole KV cache of a backend: a request needing more than this could never run."""

    blocks_total: int
    block_size: int
    how_to_grow: str = "give the engine a bigger KV cache"  # the flags that do it, for error messages


@dataclass(frozen=True)
class AdmittedRequest:
    """A Generate request that passed admission: what a backend schedules."""

    request_id: str  # "" when the caller sent none: the backend assigns one
    token_ids: list[int]
    options: SamplingOptions
    features: CheckedFeatures  # empty for text prompts
    cache_salt: str = ""
    lora_name: str = ""  # the LoRA adapter ("" = the base model); whether it is held is the backend's to say
    kv_pin: Any = None  # kv_transfer.KvPinOrder: a prefill request's pin (backend/kv_transfers.py)
    kv_import: Any = None  # kv_transfer.ImportedKv: a decode request's pulled prompt blocks
    kv_connector_params: dict | None = None  # vLLM's kv_transfer_params, for the vllm backend's connector


class Admission:
    """The checks of one loaded model under one engine configuration."""

    def __init__(self, limits: ModelLimits, mm_spec: ModelMultimodalSpec | None, policy: FeaturePolicy,
                 kv_capacity: KVCapacity, serves_lora: bool = False, media_item_rows_limit: int | None = None):
        self.serves_lora = serves_lora  # the backend has LoRA adapter slots
        self.media_item_rows_limit = media_item_rows_limit  # the backend's own bound (EngineBackend)
        self.limits = limits
        self.mm_spec = mm_spec
        self.policy = policy
        self.kv_capacity = kv_capacity

    @classmethod
    def for_backend(cls, backend: Any, policy: FeaturePolicy | None = None,
                    max_choices_per_request: int = 16) -> "Admission":
        """The admission of a started backend (its model info, media spec and KV capacity)."""
        info = backend.info
        limits = ModelLimits(vocab_size=info.vocab_size, max_context_length=info.max_context_length,
                             max_choices=min(max_choices_per_request, backend.max_running_sequences),
                             modalities=frozenset(info.modalities))
        return cls(limits, backend.mm_spec, policy or FeaturePolicy(), backend.kv_capacity,
                   serves_lora=getattr(backend, "max_loras", 0) > 0,
                   media_item_rows_limit=getattr(backend, "media_item_rows_limit", None))

    def admit(self, generate: GenerateInput) -> AdmittedRequest:
        """Check `generate`; raise a TitoError naming the field for a caller's mistake."""
        options = validate_generate(generate, self.limits)
        self._check_fits_kv_cache(len(generate.token_ids), options.max_tokens, options.n)
        # Also for text-only requests: a stray placeholder token id is refused here.
        checked = validate_structure(generate.token_ids, generate.mm_items, self.mm_spec, self.policy)
        if generate.lora_name:
            if not self.serves_lora:
                raise lora_disabled()
            check_lora_name(generate.lora_name)
        return AdmittedRequest(generate.request_id, list(generate.token_ids), options, checked, generate.cache_salt,
                               generate.lora_name)

    def largest_media_item(self) -> int:
        """The most encoder rows one media item may bring and still be admitted (0 for a model
        without media): its prompt must leave room for one generated token within the context
        limit and fit the whole KV cache with it, and an item's rows are positions of its prompt;
        a backend with a bound of its own (vLLM's encoder budget) lowers it. What a router that
        preprocesses media holds each item to (SMG's `mm_encoder_budget`)."""
        if not self.limits.modalities:
            return 0
        kv_tokens = self.kv_capacity.blocks_total * self.kv_capacity.block_size
        largest = max(min(self.limits.max_context_length, kv_tokens) - 1, 0)
        return largest if self.media_item_rows_limit is None else min(largest, self.media_item_rows_limit)

    def admit_encode(self, items: Sequence[MediaItem]) -> CheckedFeatures:
        """Check an Encode request's items."""
        return validate_encode_structure(items, self.mm_spec, self.policy)

    def sign_descriptors(self, descriptors: list[EncoderCacheDescriptor]) -> list[EncoderCacheDescriptor]:
        """Encode's descriptors, each tagged with this engine's signing key when it has one
        (tito.signing.descriptor_tag): an item render signed before it was encoded then carries
        the descriptor to any engine holding the same key (see features.py, "Trust model")."""
        if not self.policy.signing_enabled:
            return descriptors
        key_id, key = next(iter(self.policy.signing_keys.items()))
        return [dataclasses.replace(d, auth_key_id=key_id, auth_tag=signing.descriptor_tag(d, key))
                for d in descriptors]

    def _check_fits_kv_cache(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """Refuse what could never run even with the whole KV cache to itself (else it would thrash)."""
        capacity = self.kv_capacity
        need = n * blocks_for_tokens(prompt_len + max_tokens, capacity.block_size)
        if need > capacity.blocks_total:
            raise ResourceExhausted(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) x n ({n}) needs {need} KV blocks of "
                f"{capacity.block_size} tokens but the engine has {capacity.blocks_total} in all; send a smaller "
                f"max_tokens or n, or {capacity.how_to_grow}",
                reason="KV_CACHE_TOO_SMALL", field="sampling_params.max_tokens")
