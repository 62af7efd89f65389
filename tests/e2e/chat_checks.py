"""The end-to-end check shared by the engine backends: a greedy chat through the three services."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import derender_pb2, engine_pb2, render_pb2


def assert_chat_is_hf_greedy(addresses: dict[str, str], model_dir, messages, max_tokens: int = 24) -> None:
    """Render `messages`, generate, derender: the tokens are HF `generate`'s greedy tokens for the
    rendered prompt, and the streamed text and usage agree with them."""
    with ChatPipeline(Endpoints(**addresses), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(render_pb2.RenderChatRequest(
            messages=messages, sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0)),
            timeout=60)
        responses = list(pipeline.engine.Generate(rendered.generate_request, timeout=120))
        chunks = [r.chunk for r in pipeline.derender.Derender(
            iter([derender_pb2.DerenderRequest(context=rendered.derender_context)]
                 + [derender_pb2.DerenderRequest(generate_response=r) for r in responses]), timeout=60)]

    engine_tokens = [t for r in responses for t in r.token_ids]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([list(rendered.generate_request.token_ids)])
    with torch.no_grad():
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                            do_sample=False)
    assert engine_tokens == hf[0, prompt.shape[1]:].tolist()
    assert len(set(engine_tokens)) > 1, "a tiny model stuck on one token would make this test meaningless"

    content = "".join(c.content for c in chunks)
    assert content == tokenizer.decode(engine_tokens, skip_special_tokens=True)
    assert chunks[0].role == "assistant"
    assert chunks[-1].finish_reason in (engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH)
    assert chunks[-1].usage.completion_tokens == len(engine_tokens)
    assert chunks[-1].usage.prompt_tokens == len(rendered.generate_request.token_ids)
