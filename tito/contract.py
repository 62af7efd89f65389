"""Numbers and names the contract (proto/tito/v1/) documents, shared by every service that checks them."""

#: `SamplingParams.top_logprobs` / `SamplingOptions.top_logprobs`: alternatives per position, 0..20.
MAX_TOP_LOGPROBS = 20

#: The ErrorInfo reason of an out-of-range sampling field, in render and engine alike.
INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"


def _reason_names() -> frozenset[str]:
    # Imported here so the constants above stay importable without the generated stubs.
    from tito.v1 import errors_pb2

    prefix = "ERROR_REASON_"
    return frozenset(name.removeprefix(prefix) for name in errors_pb2.ErrorReason.keys()
                     if name != prefix + "UNSPECIFIED")


#: Every ErrorInfo reason the contract documents (`proto/tito/v1/errors.proto`, enum ErrorReason),
#: as sent on the wire: the value name without its ERROR_REASON_ prefix.
ERROR_REASONS: frozenset[str] = _reason_names()
