"""Admission checks for Generate, run before a request reaches the scheduler.

Every caller mistake becomes an InvalidArgument naming the offending field (dotted path as in
the proto, e.g. `token_ids[3]`, `sampling_params.top_p`), so nothing malformed can reach the
model and surface as an INTERNAL error.
"""

from __future__ import annotations

from dataclasses import dataclass

from tito.contract import INVALID_SAMPLING_PARAMS, check_logit_bias, check_sampling_ranges
from tito.errors import InvalidArgument, Violations
from tito.structured_output import validate as validate_structured_output

from tito_engine.request import GenerateInput, LogitBias, RawSamplingParams, SamplingOptions



@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model and the engine's config allow."""

    vocab_size: int
    max_context_length: int
    max_choices: int = 16
    modalities: frozenset[str] = frozenset()  # empty: text-only model


def validate_generate(request: GenerateInput, limits: ModelLimits) -> SamplingOptions:
    """Check `request` against `limits`; return its resolved sampling options or raise."""
    _check_prompt(request, limits)
    _check_media(request, limits)
    return resolve_sampling(request.sampling, len(request.token_ids), limits)


def _check_prompt(request: GenerateInput, limits: ModelLimits) -> None:
    if not request.token_ids:
        raise InvalidArgument("token_ids must not be empty", reason="EMPTY_PROMPT", field="token_ids")
    for position, token_id in enumerate(request.token_ids):
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidArgument(
                f"token id {token_id} is outside the model's vocabulary [0, {limits.vocab_size})",
                reason="TOKEN_ID_OUT_OF_RANGE", field=f"token_ids[{position}]")
    if len(request.token_ids) >= limits.max_context_length:
        raise InvalidArgument(
            f"the prompt has {len(request.token_ids)} tokens; the context limit is "
            f"{limits.max_context_length}, which leaves no room to generate",
            reason="PROMPT_TOO_LONG", field="token_ids")


def _check_media(request: GenerateInput, limits: ModelLimits) -> None:
    # The cheap first look; every other media rule is features.validate_structure's.
    for position, modality in enumerate(request.mm_modalities):
        if modality not in limits.modalities:
            supported = ", ".join(sorted(limits.modalities)) or "none: the model is text-only"
            raise InvalidArgument(
                f"the model does not accept {modality} input (supported: {supported})",
                reason="UNSUPPORTED_MODALITY", field=f"mm_features.items[{position}].modality")


def resolve_sampling(raw: RawSamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingOptions:
    """Apply the proto's documented defaults and check every range, reporting all violations."""
    violations = Violations()

    def field(name: str) -> str:
        return f"sampling_params.{name}"

    temperature = 1.0 if raw.temperature is None else raw.temperature
    top_p = 1.0 if raw.top_p is None else raw.top_p
    repetition_penalty = 1.0 if raw.repetition_penalty is None else raw.repetition_penalty
    check_sampling_ranges({"temperature": temperature, "top_p": top_p, "top_k": raw.top_k, "min_p": raw.min_p,
                           "repetition_penalty": repetition_penalty, "presence_penalty": raw.presence_penalty,
                           "frequency_penalty": raw.frequency_penalty, "top_logprobs": raw.top_logprobs,
                           "logprobs": raw.logprobs}, violations, "sampling_params")
    n = 1 if raw.n is None else raw.n
    if not 1 <= n <= limits.max_choices:
        violations.add(field("n"), f"must be between 1 and {limits.max_choices}, got {n}")
    for position, token_id in enumerate(raw.stop_token_ids):
        if not 0 <= token_id < limits.vocab_size:
            violations.add(field(f"stop_token_ids[{position}]"),
                           f"token id {token_id} is outside the vocabulary [0, {limits.vocab_size})")
    check_logit_bias(raw.logit_bias, limits.vocab_size, violations, field("logit_bias"))
    _check_prior_output(raw, n, prompt_len, violations)

    room = limits.max_context_length - prompt_len
    if raw.max_tokens is not None:
        if raw.max_tokens < 1:
            violations.add(field("max_tokens"), "must be >= 1 (leave it unset to generate up to the context limit)")
        elif raw.max_tokens > room:
            violations.add(field("max_tokens"),
                           f"prompt ({prompt_len} tokens) + max_tokens ({raw.max_tokens}) exceeds the context "
                           f"limit of {limits.max_context_length} tokens; at most {room} fits")
    max_tokens = room if raw.max_tokens is None else raw.max_tokens
    if raw.min_tokens > max_tokens:
        violations.add(field("min_tokens"), f"must not exceed max_tokens ({max_tokens}), got {raw.min_tokens}")
    violations.raise_if_any(reason=INVALID_SAMPLING_PARAMS)
    if raw.structured_output is not None:
        validate_structured_output(raw.structured_output)

    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=raw.min_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=0 if raw.top_k == -1 else raw.top_k,
        min_p=float(raw.min_p),
        seed=raw.seed,
        stop_token_ids=frozenset(raw.stop_token_ids),
        ignore_eos=raw.ignore_eos,
        n=n,
        presence_penalty=float(raw.presence_penalty),
        frequency_penalty=float(raw.frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        logprobs=raw.logprobs,
        top_logprobs=raw.top_logprobs,
        structured_output=raw.structured_output,
        logit_bias=LogitBias.from_mapping(raw.logit_bias),
        prior_output_tokens=raw.prior_output_tokens,
    )


def _check_prior_output(raw: RawSamplingParams, n: int, prompt_len: int, violations: Violations) -> None:
    """A continued choice (request migration) is one choice whose prompt still holds the original
    prompt (a router continues each choice of an n > 1 request on its own). A constrained choice
    continues too: the engine core advances its grammar over the earlier output."""
    prior = raw.prior_output_tokens
    if not prior:
        return
    name = "sampling_params.prior_output_tokens"
    if prior >= prompt_len:
        violations.add(name, f"must be below the number of token_ids ({prompt_len}), got {prior}")
    if n != 1:
        violations.add(name, f"continues one choice: needs n = 1, got n = {n}")
