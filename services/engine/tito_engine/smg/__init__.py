"""The engine's second protocol face: SMG's `vllm.grpc.engine.VllmEngine` (PyPI smg-grpc-proto).

A thin servicer (`servicer.py`) and its converter (`convert.py`) over the same admission, backend,
caches and KV events as tito.v1's servicer; the few things this protocol asks of the engine that
tito.v1 leaves to derender (stop strings: `stops.py`, `stream.py`) and the facts it reports
(`facts.py`, `tokenizer_bundle.py`) are plain domain modules here.
"""
