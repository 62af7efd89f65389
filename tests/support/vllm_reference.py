"""vLLM's own AsyncLLM as a reference for the vllm backend's tests: configured by hand for a
checkpoint (no tito code), run on a private event loop so synchronous tests can call it, greedy.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any


class AsyncLLMReference:
    """vLLM's AsyncLLM built from `engine_args` (AsyncEngineArgs' fields) on its own event loop."""

    def __init__(self, model_dir: str, timeout: float, **engine_args: Any):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._timeout = timeout
        self._ids = itertools.count()  # vLLM refuses a request id still in flight
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="asyncllm")
        self._thread.start()
        # generation_config="vllm": the checkpoint's generation_config.json would otherwise change
        # vLLM's default sampling, as it does not on tito's backend (which sets the same).
        args = AsyncEngineArgs(model=model_dir, generation_config="vllm", enforce_eager=True, **engine_args)

        async def build():
            return AsyncLLM.from_engine_args(args)

        self._llm = self._run(build())

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=self._timeout)

    async def _greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool, lora: Any) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        async for output in self._llm.generate(tokens_input(prompt), params, f"reference-{next(self._ids)}",
                                               lora_request=lora):
            tokens.extend(output.outputs[0].token_ids)
        return tokens

    def alone(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False,
              loras: list[Any] | None = None) -> list[list[int]]:
        """Greedy tokens of each prompt, one request at a time; `loras[i]` is prompt i's
        vllm LoRARequest (None: the base model)."""
        loras = loras or [None] * len(prompts)
        return [self._run(self._greedy(prompt, max_tokens, ignore_eos, lora))
                for prompt, lora in zip(prompts, loras, strict=True)]

    def together(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False,
                 loras: list[Any] | None = None) -> list[list[int]]:
        """As `alone`, with every request in flight at once (vLLM batches them)."""
        loras = loras or [None] * len(prompts)

        async def every():
            return list(await asyncio.gather(*(self._greedy(prompt, max_tokens, ignore_eos, lora)
                                               for prompt, lora in zip(prompts, loras, strict=True))))

        return self._run(every())

    def close(self) -> None:
        """Shut vLLM's engine down (its processes, memory and threads) and stop the loop."""
        self._llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
