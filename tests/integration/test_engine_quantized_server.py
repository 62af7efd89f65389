"""Quantized weights served over gRPC (port 0): `--quantization int8` and an int4 GPTQ checkpoint
reach the engine's core, whose greedy streams equal the quantized runner's own tokens."""

from __future__ import annotations

import pytest

from engine_calls import collect, request
from engine_greedy import engine_greedy
from int4_checkpoints import write_int4_checkpoint
from tito.v1 import engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.model.runner import ModelRunner
from tito_engine.server import create_server

TIMEOUT = 30
NEW_TOKENS = 12
PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 17], [42, 43]]


@pytest.fixture(scope="module")
def gptq_dir(tiny_text_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "tiny-qwen2-gptq"
    write_int4_checkpoint(tiny_text_model, out, "gptq", 32)
    return out


@pytest.mark.parametrize("served", ["int8", "gptq"])
def test_quantized_greedy_streams_equal_the_quantized_runner(served, aio_server, tiny_text_model, gptq_dir):
    model_dir, quantization = (tiny_text_model, "int8") if served == "int8" else (gptq_dir, "none")
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=64, engine_process=False,
                          quantization=quantization, dtype="float32")
    stub = engine_pb2_grpc.EngineServiceStub(aio_server(lambda: create_server(config)).channel())
    runner = ModelRunner(model_dir, model_id=served, device="cpu", dtype="float32", quantization=quantization)
    float_runner = ModelRunner(tiny_text_model, model_id="float", device="cpu", dtype="float32")
    differs_from_float = False
    for prompt in PROMPTS:
        tokens, _ = collect(stub.Generate(request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True), timeout=TIMEOUT))
        expected = engine_greedy(runner, [prompt], NEW_TOKENS)[0]
        assert tokens[0] == expected, f"{served}: served {tokens[0]} != the quantized runner's {expected}"
        differs_from_float |= expected != engine_greedy(float_runner, [prompt], NEW_TOKENS)[0]
    assert differs_from_float, f"{served}: every stream equals the float model's, so nothing shows it was quantized"
