"""Building SMG `vllm.grpc.engine.VllmEngine` Generate requests and reading their streams, for the
tests of the engine's SMG face."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2

from tito.grpc_errors import error_details

from tito_cli.smg import smg_executable


def smg_command() -> str | None:
    """SMG's `smg` command (PyPI smg, in tito's test extra), found as `tito serve all --smg-address`
    finds it; None when it is not installed."""
    return smg_executable()


def smg_request(prompt, request_id="r", stream=True, **sampling) -> vllm_engine_pb2.GenerateRequest:
    """A tokenized Generate request; greedy unless `temperature` is given."""
    sampling.setdefault("temperature", 0.0)
    return vllm_engine_pb2.GenerateRequest(request_id=request_id, stream=stream,
                                           tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
                                           sampling_params=vllm_engine_pb2.SamplingParams(**sampling))


@dataclass
class SmgStream:
    """What one Generate stream said, per choice index: the chunks' tokens in order, the
    complete's message, and the kinds of message in arrival order."""

    chunk_tokens: dict[int, list[int]] = field(default_factory=dict)
    completes: dict[int, vllm_engine_pb2.GenerateComplete] = field(default_factory=dict)
    kinds: list[tuple[str, int]] = field(default_factory=list)

    def tokens(self, index: int = 0) -> list[int]:
        """The choice's tokens: its chunks' when streamed, else its complete's."""
        if index in self.chunk_tokens:
            return self.chunk_tokens[index]
        return list(self.completes[index].output_ids)


def stream_refusal(responses) -> dict:
    """The error details of a Generate stream that must fail."""
    with pytest.raises(grpc.RpcError) as caught:
        list(responses)
    return error_details(caught.value)


def read_stream(responses) -> SmgStream:
    result = SmgStream()
    for response in responses:
        kind = response.WhichOneof("response")
        message = getattr(response, kind)
        result.kinds.append((kind, message.index))
        if kind == "chunk":
            assert message.index not in result.completes, "a chunk after its choice's complete"
            result.chunk_tokens.setdefault(message.index, []).extend(message.token_ids)
        else:
            assert message.index not in result.completes, "a choice completed twice"
            result.completes[message.index] = message
    return result


def text_stop(tokenizer, tokens, at) -> str:
    """A stop string that the text of tokens[at] completes: that token's text, and what precedes
    it (nothing earlier contains it); skips the test when no such string isolates that token."""
    for start in range(at):
        text = tokenizer.decode(tokens[start:at + 1])
        before = tokenizer.decode(tokens[:at])
        candidate = text.strip()
        if candidate and candidate not in before and candidate in tokenizer.decode(tokens[:at + 1]):
            return candidate
    pytest.skip("no stop string isolates that token in this output")
