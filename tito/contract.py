"""Numbers and names the contract (proto/tito/v1/) documents, shared by every service that checks them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tito.errors import Violations

#: `SamplingParams.top_logprobs` / `SamplingOptions.top_logprobs`: alternatives per position, 0..20.
MAX_TOP_LOGPROBS = 20

#: The ErrorInfo reason of an out-of-range sampling field, in render and engine alike.
INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"

#: Stop strings (`OutputTextOptions.stop`): at most this many per request, each at most
#: MAX_STOP_STRING_CHARS characters. Derender matches every stop string against each piece of
#: output, so the bound is what keeps its per-token cost bounded. Render refuses more
#: (INVALID_SAMPLING_PARAMS on `sampling.stop`), derender refuses a context with more
#: (STOP_STRINGS_TOO_LARGE on `context.text_options.stop`).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024

#: `logit_bias` (OpenAI's): each bias within +-LOGIT_BIAS_LIMIT (OpenAI's range), at most
#: MAX_LOGIT_BIAS_ENTRIES token ids. The bound keeps what one request adds to every step of the
#: sampler, and to the request itself, small.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingRange:
    """The documented range of one sampling field (sampling.proto)."""

    accepts: Callable[[float], bool]
    expectation: str  # what the field must be, as error messages say it


#: One table for render (request SamplingOptions) and engine (SamplingParams): the same field is
#: refused the same way in both. NaN and infinities never pass. `n` is not here: its limit is each
#: service's configuration.
SAMPLING_RANGES: Mapping[str, SamplingRange] = {
    "temperature": SamplingRange(lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": SamplingRange(lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": SamplingRange(lambda v: v >= -1, "-1 or 0 (both disable it) or a positive count"),
    "min_p": SamplingRange(lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": SamplingRange(lambda v: v > 0, "> 0 (1 disables it)"),
    "presence_penalty": SamplingRange(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": SamplingRange(lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "top_logprobs": SamplingRange(lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}"),
}


def check_sampling_ranges(values: Mapping[str, float], violations: Violations, field_prefix: str) -> None:
    """Add a violation `<field_prefix>.<name>` for each value outside its SAMPLING_RANGES range,
    and for top_logprobs without logprobs (pass `logprobs` among `values`)."""
    for name, value in values.items():
        rule = SAMPLING_RANGES.get(name)
        if rule is not None and not (math.isfinite(value) and rule.accepts(value)):
            violations.add(f"{field_prefix}.{name}", f"{name}={value} is out of range: must be {rule.expectation}")
    top_logprobs = values.get("top_logprobs", 0)
    if 0 < top_logprobs <= MAX_TOP_LOGPROBS and not values.get("logprobs", False):
        violations.add(f"{field_prefix}.top_logprobs", "top_logprobs needs logprobs=true")


def check_logit_bias(bias: Mapping[int, float], vocab_size: int, violations: Violations, field: str) -> None:
    """Add at most one violation for `bias` (token id -> bias): `<field>` when it has too many
    entries, else `<field>[<id>]` for the lowest id outside [0, vocab_size) or whose bias is not a
    finite number within +-LOGIT_BIAS_LIMIT. One, not one per entry: a thousand wrong entries
    would make a status too large for gRPC's trailers."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        violations.add(field, f"{len(bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES}")
        return
    wrong = [(token_id, problem) for token_id, value in sorted(bias.items())
             if (problem := _logit_bias_problem(token_id, value, vocab_size))]
    if wrong:
        token_id, problem = wrong[0]
        more = f" ({len(wrong) - 1} more entries are wrong too)" if len(wrong) > 1 else ""
        violations.add(f"{field}[{token_id}]", problem + more)


def _logit_bias_problem(token_id: int, value: float, vocab_size: int) -> str | None:
    if not 0 <= token_id < vocab_size:
        return f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
    if not (math.isfinite(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
        return f"bias {value} is out of range: must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    return None


def _reason_names() -> frozenset[str]:
    # Imported here so the constants above stay importable without the generated stubs.
    from tito.v1 import errors_pb2

    prefix = "ERROR_REASON_"
    return frozenset(name.removeprefix(prefix) for name in errors_pb2.ErrorReason.keys()
                     if name != prefix + "UNSPECIFIED")


#: Every ErrorInfo reason the contract documents (`proto/tito/v1/errors.proto`, enum ErrorReason),
#: as sent on the wire: the value name without its ERROR_REASON_ prefix.
ERROR_REASONS: frozenset[str] = _reason_names()
