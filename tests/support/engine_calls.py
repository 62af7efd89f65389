"""Building Generate requests and reading their streams, for the engine's integration tests."""

from __future__ import annotations

from tito.v1 import engine_pb2, sampling_pb2


def request(prompt, request_id="", **sampling) -> engine_pb2.GenerateRequest:
    """A Generate request; greedy unless `temperature` is given."""
    sampling.setdefault("temperature", 0.0)
    return engine_pb2.GenerateRequest(request_id=request_id, token_ids=prompt,
                                      sampling_params=sampling_pb2.SamplingParams(**sampling))


def collect(responses):
    """Tokens per choice index and the final message of each choice."""
    tokens, finals = {}, {}
    for response in responses:
        tokens.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            assert response.index not in finals, "a choice finished twice"
            finals[response.index] = response
    return tokens, finals
