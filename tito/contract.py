"""Numbers and names the contract (proto/tito/v1/) documents, shared by every service that checks them."""

#: `SamplingParams.top_logprobs` / `SamplingOptions.top_logprobs`: alternatives per position, 0..20.
MAX_TOP_LOGPROBS = 20

#: The ErrorInfo reason of an out-of-range sampling field, in render and engine alike.
INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"
