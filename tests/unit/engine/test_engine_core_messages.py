"""Every message on the engine's core pipe pickles and comes back equal (the core may run in a
child process)."""

import pickle

import pytest

from tito.errors import InvalidArgument
from tito_engine.core.messages import (AbortRequest, AddRequest, CoreFailed, CoreLoad, CoreStopped, EncodeResult,
                                       StepBatch, StopCore)
from tito_engine.request import ChoiceOutput, SamplingOptions


@pytest.mark.parametrize("message", [
    AddRequest(3, "req-1", [1, 2, 3], SamplingOptions(max_tokens=4, temperature=0.0), None, 12.5, "salt"),
    AbortRequest(3),
    StopCore(),
    CoreFailed("OSError: no such model"),
    CoreStopped(),
    StepBatch([(3, ChoiceOutput(0, (7, 8)), False), (4, EncodeResult((b"x",)), True)], CoreLoad(1, 0, 2, 3, 4)),
])
def test_messages_survive_the_pipe(message):
    assert pickle.loads(pickle.dumps(message)) == message


def test_a_refusal_inside_a_batch_keeps_its_code_reason_and_field():
    refusal = InvalidArgument("bad", reason="MM_TENSORS_REQUIRED", field="mm_features.items[0]")
    batch = pickle.loads(pickle.dumps(StepBatch([(5, refusal, True)], CoreLoad(0, 0, 0, 0, 1))))
    (_, error, finished), = batch.outputs
    assert isinstance(error, InvalidArgument) and finished
    assert (error.reason, error.field) == ("MM_TENSORS_REQUIRED", "mm_features.items[0]")

