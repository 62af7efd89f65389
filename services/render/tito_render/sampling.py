"""Resolve a client's SamplingOptions into the engine's SamplingParams (`domain.SamplingParams`).

Every value is: the request's, else the model's generation_config.json default, else tito's
default, and render always writes the resolved value so the engine never guesses. max_tokens
absent means the context remainder (or the generation config's max_new_tokens when smaller).

`do_sample: false` in the generation config (Hugging Face decodes such a model greedily) makes
the default temperature 0, unless the request asks for sampling: it sets temperature, or
shapes the distribution with top_p, top_k or min_p (then the generation config's temperature,
else 1.0). The render README lists every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tito.contract import (INVALID_SAMPLING_PARAMS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, check_logit_bias,
                           check_sampling_ranges)
from tito.errors import InvalidArgument, Violations
from tito.parsers import TOOL_PARSERS_NEEDING_SPECIAL_TOKENS

from tito_render.domain import SamplingOptions, SamplingParams, TextOptions, ToolChoice, ToolChoiceMode

MAX_N = 128

#: Request fields that only mean something when sampling: setting one asks for sampling even
#: where the generation config says do_sample false.
SAMPLING_SHAPE_FIELDS = ("top_p", "top_k", "min_p")

#: tito's own defaults (used when neither the request nor the generation config sets a value).
TITO_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1,
}


@dataclass(frozen=True)
class SamplingLimits:
    """What resolution needs to know about the model and the prompt."""

    prompt_tokens: int
    max_context_length: int
    vocab_size: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    #: The request field that holds the prompt, named when the prompt itself is too long.
    prompt_field: str = "messages"


def _pick(options: SamplingOptions, name: str, defaults: dict[str, Any]) -> Any:
    value = getattr(options, name)
    if value is not None:
        return value
    return defaults.get(name, TITO_DEFAULTS.get(name))


def _default_temperature(options: SamplingOptions, defaults: dict[str, Any]) -> float:
    """The temperature of a request that sets none: greedy (0) for a `do_sample: false` model
    unless the request shapes sampling, else the generation config's, else tito's (1.0)."""
    if defaults.get("do_sample") is False and not any(
            getattr(options, name) is not None for name in SAMPLING_SHAPE_FIELDS):
        return 0.0
    return float(defaults.get("temperature", TITO_DEFAULTS["temperature"]))


def check_context(limits: SamplingLimits) -> int:
    """Context tokens left for generation; the prompt must leave at least one."""
    remainder = limits.max_context_length - limits.prompt_tokens
    if remainder < 1:
        raise InvalidArgument(
            f"prompt is {limits.prompt_tokens} tokens, context limit {limits.max_context_length}: "
            f"shorten the prompt so at least one token can be generated",
            reason="PROMPT_TOO_LONG", field=limits.prompt_field)
    return remainder


def resolve_sampling(options: SamplingOptions, limits: SamplingLimits) -> SamplingParams:
    """Validate `options` (every problem named as sampling.<field>) and resolve them."""
    remainder = check_context(limits)
    defaults = limits.generation_defaults
    violations = Violations()

    temperature = options.temperature if options.temperature is not None else _default_temperature(options, defaults)
    top_p = float(_pick(options, "top_p", defaults))
    min_p = float(_pick(options, "min_p", defaults))
    repetition_penalty = float(_pick(options, "repetition_penalty", defaults))
    presence_penalty = float(_pick(options, "presence_penalty", defaults))
    frequency_penalty = float(_pick(options, "frequency_penalty", defaults))
    top_k = int(_pick(options, "top_k", defaults))
    logprobs = options.logprobs if options.logprobs is not None else False
    top_logprobs = options.top_logprobs if options.top_logprobs is not None else 0
    check_sampling_ranges({"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                           "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                           "frequency_penalty": frequency_penalty, "top_logprobs": top_logprobs,
                           "logprobs": logprobs}, violations, "sampling")
    top_k = max(top_k, 0)  # -1 and 0 both mean "disabled"; emit the one documented default

    if options.max_tokens is not None:
        max_tokens = options.max_tokens
        if max_tokens < 1:
            violations.add("sampling.max_tokens", "max_tokens must be >= 1")
        elif max_tokens > remainder:
            violations.add("sampling.max_tokens",
                           f"max_tokens={max_tokens} exceeds the context remainder: the prompt is "
                           f"{limits.prompt_tokens} tokens, context limit {limits.max_context_length}, "
                           f"so at most {remainder}")
    else:
        generation_max = defaults.get("max_new_tokens")
        max_tokens = min(remainder, int(generation_max)) if generation_max and generation_max > 0 else remainder
    min_tokens = options.min_tokens if options.min_tokens is not None else 0
    if min_tokens > max_tokens:
        violations.add("sampling.min_tokens", f"min_tokens={min_tokens} exceeds max_tokens={max_tokens}")

    n = options.n if options.n is not None else int(TITO_DEFAULTS["n"])
    if not 1 <= n <= MAX_N:
        violations.add("sampling.n", f"n={n} must be between 1 and {MAX_N}")

    if len(options.stop) > MAX_STOP_STRINGS:
        violations.add("sampling.stop", f"{len(options.stop)} stop strings: at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(options.stop):
        if not stop:
            violations.add(f"sampling.stop[{i}]", "stop string is empty")
        elif len(stop) > MAX_STOP_STRING_CHARS:
            violations.add(f"sampling.stop[{i}]", f"stop string of {len(stop)} characters: at most "
                                                  f"{MAX_STOP_STRING_CHARS}")
    for i, token_id in enumerate(options.stop_token_ids):
        if token_id >= limits.vocab_size:
            violations.add(f"sampling.stop_token_ids[{i}]",
                           f"token id {token_id} is outside the vocabulary [0, {limits.vocab_size})")
    check_logit_bias(options.logit_bias, limits.vocab_size, violations, "sampling.logit_bias")
    violations.raise_if_any(reason=INVALID_SAMPLING_PARAMS)

    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, stop_token_ids=tuple(options.stop_token_ids),
        ignore_eos=options.ignore_eos if options.ignore_eos is not None else False, n=n,
        logprobs=logprobs, top_logprobs=top_logprobs, text_options=text_options(options),
        seed=options.seed, logit_bias=tuple(sorted(options.logit_bias.items())))


def keeps_special_tokens_for_tools(tool_parser: str, has_tools: bool, tool_choice: ToolChoice,
                                   options: SamplingOptions) -> bool:
    """Whether a chat's text must keep special tokens for its tool parser: the parser's markup is
    special tokens (Mistral's [TOOL_CALLS]), derender will parse calls (tools offered, tool_choice
    not none) and the request left skip_special_tokens unset (a request that sets it wins)."""
    return (tool_parser in TOOL_PARSERS_NEEDING_SPECIAL_TOKENS and has_tools
            and tool_choice.mode != ToolChoiceMode.NONE
            and options.skip_special_tokens is None)


def text_options(options: SamplingOptions) -> TextOptions:
    """The string-level options derender applies, with their defaults made explicit."""
    return TextOptions(
        stop=tuple(options.stop),
        include_stop_str_in_output=options.include_stop_str_in_output
        if options.include_stop_str_in_output is not None else False,
        skip_special_tokens=options.skip_special_tokens if options.skip_special_tokens is not None else True,
        # Default false: the text then equals the tokenizer's own decode (see the contract).
        spaces_between_special_tokens=options.spaces_between_special_tokens
        if options.spaces_between_special_tokens is not None else False)
