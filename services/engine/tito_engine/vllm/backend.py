"""The vllm backend: tito's EngineService served by vLLM's AsyncLLM in the engine process.

vLLM brings its kernels, tensor/pipeline/data parallelism and multi-node executor; tito keeps the
contract. Requests arrive admitted (admission.py, the same checks as the native engine), become
vLLM inputs (inputs.py: token ids, sampling parameters with the contract's semantics,
media items), and their outputs come back as the same ChoiceOutputs the native engine streams.

What vLLM raises for a caller's mistake maps into tito's error model here (one place); anything
else is a bug and stays INTERNAL. GetLoad comes from vLLM's scheduler statistics (a stat logger
vLLM calls after every step) bounded by what tito knows is live, so an idle engine reads 0.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tito.config import ConfigError
from tito.errors import FailedPrecondition, InvalidArgument, TitoError, Unavailable

from tito_engine.kv_events import KvEventLog
from tito_engine.lora_types import LoraAdapterInfo, lora_disabled
from tito_engine.backend.admission import AdmittedRequest, KVCapacity
from tito_engine.backend.interface import LoadSnapshot, check_can_accept
from tito_engine.multimodal.features import CheckedFeatures
from tito_engine.model_info import describe_model
from tito_engine.request import ChoiceOutput
from tito_engine.vllm.args import check_can_start
from tito_engine.vllm.inputs import (MediaConverter, OutputConverter, engine_input, sampling_params,
                                     with_kv_transfer_params)
from tito_engine.vllm.lora import VllmLoraAdapters

log = logging.getLogger(__name__)


class _SchedulerStats:
    """The latest scheduler statistics vLLM reported (running, waiting, KV use, prefix hits)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_hit_tokens = 0

    def factory(self) -> Callable[..., Any]:
        """A vLLM StatLoggerFactory whose loggers feed this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _Tap(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is None:
                    return
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                stats.prefix_cache_hit_tokens += scheduler_stats.prefix_cache_stats.hits

            def log_engine_initialized(self):
                pass

        return _Tap


def _first_reason(exc: Exception) -> str:
    """One line saying why vLLM refused to start (pydantic config errors carry it in errors())."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return _short(str(errors()[0]["msg"]).removeprefix("Value error, "))
        except Exception:  # noqa: BLE001 - not pydantic's after all
            pass
    lines = str(exc).strip().splitlines()
    return _short(f"{type(exc).__name__}: {lines[0] if lines else ''}")


def _short(reason: str, limit: int = 300) -> str:
    """A reason fit for one line: vLLM appends long lists (every architecture it supports) to some."""
    if len(reason) <= limit:
        return reason
    cut = reason.find(". ", 0, limit)
    return reason[:cut + 1] if cut > 0 else reason[:limit] + "..."


def encoder_budget(vllm_config: Any) -> int | None:
    """vLLM's encoder budget: the most encoder rows one media item may bring and still be
    scheduled (the lesser of its encoder compute budget and its encoder cache, the "budget of N
    tokens" of its start-up line; its own front end refuses an item above it), from the helper its
    front end and model runner share. None for a text model, and when the helper cannot tell: the
    number is only advertised (GetServerInfo), so it must not stop an engine that serves."""
    if not vllm_config.model_config.is_multimodal_model:
        return None
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    try:
        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False).get_encoder_budget()
    except Exception:  # noqa: BLE001 - an unexpected model or config shape: advertise admission's bound alone
        log.warning("could not read vLLM's encoder budget; GetServerInfo advertises admission's bound alone",
                    exc_info=True)
        return None
    return max(int(budget), 0)


def _device_name(vllm_config: Any) -> str:
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    device = current_platform.device_type
    return device if parallel.world_size == 1 else f"{device} x{parallel.world_size}"


class VllmEngine:
    kv_connector = True  # prefill/decode through the connector vLLM's --kv-transfer-config configures
    """An EngineBackend over vLLM's AsyncLLM (see backend.EngineBackend). It may be built off the
    event loop (the model loads meanwhile); `start()` and every call after run on the serving loop,
    where AsyncLLM starts its output handler."""

    def __init__(self, engine_args: Any, model_dir: Path, *, model_id: str, max_waiting_requests: int = 1024,
                 kv_event_buffer: int = 10_000, kv_flag_given: bool = True, lora_dir: str = "",
                 lora_modules: tuple[tuple[str, str], ...] = ()):
        """`lora_dir` (with `engine_args.enable_lora`): LoRA adapters through vLLM's own support
        (vllm/lora.py), `lora_modules` (name, path) held from the start."""
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        self.kv_events = KvEventLog(kv_event_buffer)
        self._kv_relay = None

        self._stats = _SchedulerStats()
        # vLLM's config first, in this process: a model or setting vLLM refuses is one line here,
        # before any engine process starts; then what vLLM's workers would refuse after loading.
        try:
            vllm_config = engine_args.create_engine_config()
        except Exception as exc:  # noqa: BLE001 - pydantic, ValueError, OSError: vLLM's config checks
            raise ConfigError(f"vLLM cannot serve --model {model_id}: {_first_reason(exc)}") from exc
        check_can_start(vllm_config, str(model_dir), model_id=model_id, kv_flag_given=kv_flag_given)
        try:
            self._llm = AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                                 log_requests=engine_args.enable_log_requests,
                                 log_stats=not engine_args.disable_log_stats,
                                 stat_loggers=[self._stats.factory()])
        except Exception as exc:  # noqa: BLE001 - vLLM reports a model it cannot serve in many ways
            raise ConfigError(f"vLLM's engine core could not start on --model {model_id} ({_first_reason(exc)}; "
                              f"its log above says why)") from exc
        # What vLLM's own engine processes do once started: read its environment variables once,
        # not at every lookup (its per-token statistics consult several of them).
        from vllm.envs import enable_envs_cache

        enable_envs_cache()
        vllm_config = self._llm.vllm_config
        events_config = vllm_config.kv_events_config
        if events_config is not None and events_config.enable_kv_cache_events:
            from tito_engine.vllm.kv_relay import VllmKvEventRelay

            self._kv_relay = VllmKvEventRelay(self.kv_events, events_config.endpoint, events_config.replay_endpoint)
        model_config = vllm_config.model_config
        hf_config = model_config.hf_config
        self.info, self.mm_spec = describe_model(
            Path(model_dir), hf_config, model_id=model_id,
            vocab_size=model_config.get_vocab_size(),  # embedding rows, padding included
            max_context_length=model_config.max_model_len, dtype=str(model_config.dtype).removeprefix("torch."),
            device=_device_name(vllm_config), multimodal=model_config.is_multimodal_model)
        self.max_running_sequences = vllm_config.scheduler_config.max_num_seqs
        self.max_loras = self.max_lora_rank = 0  # no LoRA: admission refuses lora_name (LORA_DISABLED)
        self._lora: VllmLoraAdapters | None = None
        lora_config = vllm_config.lora_config
        if lora_config is not None and lora_dir:
            self.max_loras, self.max_lora_rank = lora_config.max_loras, lora_config.max_lora_rank
            self._lora = VllmLoraAdapters(self._llm, Path(lora_dir), self.max_lora_rank)
            for name, path in lora_modules:
                try:
                    self._lora.register(name, path)
                except TitoError as exc:
                    self._llm.shutdown()
                    raise ConfigError(f"--lora-modules {name}={path}: {exc.message}") from None
        self.max_waiting_requests = max_waiting_requests
        cache_config = vllm_config.cache_config
        self.kv_capacity = KVCapacity(
            int(cache_config.num_gpu_blocks or 0), int(cache_config.block_size),
            how_to_grow="give vLLM more KV cache memory (--kv-cache-bytes, or -- --gpu-memory-utilization)")
        self.media_item_rows_limit = encoder_budget(vllm_config)
        transfer_config = vllm_config.kv_transfer_config
        self.kv_connector_name = (transfer_config.kv_connector or "") if transfer_config is not None else ""
        self.on_core_lost: Callable[[], None] | None = None
        # vLLM's engine core does not come back once dead: this replica must be restarted.
        self.on_core_restored: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> choices (n), until its stream ends
        self._finished = 0
        self._mm_hits = 0
        self._mm_misses = 0
        self._media: MediaConverter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()  # aborts in flight (the loop only keeps weak references)
        self._stopping = False
        log.info("vLLM engine ready: %s on %s (%s), vocab %d, context %d, %d KV blocks x %d tokens, "
                 "max_num_seqs %d", model_id, self.info.device, self.info.dtype, self.info.vocab_size,
                 self.info.max_context_length, self.kv_capacity.blocks_total, self.kv_capacity.block_size,
                 self.max_running_sequences)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._watch_core())
        if self._lora is not None:  # vLLM reads the --lora-modules adapters now, not at their first request
            for adapter in self._lora.infos():
                self._spawn(self._lora.preload(adapter.name))
        if self._kv_relay is not None:
            self._kv_relay.start()

    def _spawn(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_core(self) -> None:
        """Tell the server when vLLM's engine core died (health turns NOT_SERVING)."""
        while not self._stopping:
            try:
                await self._llm.check_health()
            except Exception:  # noqa: BLE001 - vLLM raises EngineDeadError (or worse) once its core is gone
                pass
            if self._llm.errored:
                log.error("vLLM's engine core died; this replica must be restarted")
                if self.on_core_lost is not None:
                    self.on_core_lost()
                return
            await asyncio.sleep(1.0)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut vLLM down (from any thread; the server calls it off its event loop)."""
        self._stopping = True  # the watchdog sees it within a second and returns
        self._llm.shutdown(timeout=timeout)
        if self._kv_relay is not None:
            self._kv_relay.stop()
        self.kv_events.close()

    # ---------------------------------------------------------------- requests

    def _register(self, request_id: str, n: int) -> None:
        with self._lock:
            check_can_accept(request_id, live=self._live, waiting=self._waiting_locked(),
                             max_waiting=self.max_waiting_requests, core_lost=self._llm.errored,
                             stopping=self._stopping)
            self._live[request_id] = n

    async def generate(self, request: AdmittedRequest) -> AsyncIterator[ChoiceOutput]:
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        # Registered first: a request refused here (duplicate id, full queue) must not have touched
        # vLLM's multimodal cache bookkeeping in _engine_input.
        self._register(request_id, request.options.n)
        converter = OutputConverter(request.options, len(request.token_ids))
        finished = False
        stream = None
        adapter = None
        try:
            try:
                if request.lora_name:
                    adapter = self._lora.acquire(request.lora_name)  # admission let it through: LoRA is on
                prompt = self._engine_input(request)
                params = with_kv_transfer_params(sampling_params(request.options, self.info.eos_token_ids),
                                                 request.kv_connector_params)
                stream = self._llm.generate(prompt, params, request_id, lora_request=adapter)
                async for output in stream:
                    for choice in converter.convert(output):
                        yield choice
                finished = True
            except TitoError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped in one place; a bug re-raises as is
                raise _map_vllm_error(exc) from exc
        finally:
            with self._lock:
                self._live.pop(request_id, None)
                if finished:
                    self._finished += 1
            if stream is not None and not finished:
                await stream.aclose()  # vLLM aborts the request when its generator is closed early
            if adapter is not None:
                await self._lora.release(request.lora_name)

    def _engine_input(self, request: AdmittedRequest) -> Any:
        if request.features and self._media is None:
            self._media = MediaConverter.for_llm(self._llm)  # built on first use: it loads the HF processor
        prompt, hits, misses = engine_input(request, self._media)
        with self._lock:
            self._mm_hits += hits
            self._mm_misses += misses
        return prompt

    async def encode(self, features: CheckedFeatures) -> list[Any]:
        raise FailedPrecondition(
            "Encode is not available on the vllm backend: vLLM keeps encoder outputs inside its engine "
            "core and hands out no descriptors for them; send Generate with mm_payload TENSORS (vLLM caches "
            "the items by mm_hash and reuses them for later requests)", reason="ENCODE_UNSUPPORTED")

    async def reset_prefix_cache(self) -> None:
        """vLLM empties its prefix cache only while no request holds blocks; its AllBlocksCleared
        event is published with its next scheduler step."""
        if not await self._llm.reset_prefix_cache():
            raise FailedPrecondition("vLLM resets its prefix cache only while no request holds KV blocks; retry "
                                     "when the engine is idle (GetLoad running_requests 0)",
                                     reason="PREFIX_CACHE_BUSY")

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        if self._lora is None:
            raise lora_disabled()
        return await self._lora.load(name, path)

    async def unload_lora_adapter(self, name: str) -> int:
        if self._lora is None:
            raise lora_disabled()
        return await self._lora.unload(name)

    async def list_lora_adapters(self) -> tuple[LoraAdapterInfo, ...]:
        return self._lora.infos() if self._lora is not None else ()

    def abort(self, request_ids: list[str]) -> list[str]:
        with self._lock:
            found = [request_id for request_id in request_ids if request_id in self._live]
        if found:
            # The streams end with a final ABORT output that vLLM's output processor produces.
            self._spawn(self._llm.abort(found))
        return found

    # ---------------------------------------------------------------- load

    def _waiting_locked(self) -> int:
        live_choices = sum(self._live.values())
        return max(0, live_choices - min(self._stats.running, live_choices))

    def load(self) -> LoadSnapshot:
        with self._lock:
            live_choices = sum(self._live.values())
            running = min(self._stats.running, live_choices)
            total = self.kv_capacity.blocks_total
            return LoadSnapshot(
                running_requests=running,
                waiting_requests=live_choices - running,
                finished_requests=self._finished,
                kv_blocks_total=total,
                kv_blocks_used=round(self._stats.kv_cache_usage * total) if live_choices else 0,
                kv_block_size=self.kv_capacity.block_size,
                prefix_cache_hit_tokens=self._stats.prefix_cache_hit_tokens,
                encoder_cache_hits=self._mm_hits,
                encoder_cache_misses=self._mm_misses,
                lora_adapters=self._lora.infos() if self._lora is not None else (),
            )


def _map_vllm_error(exc: Exception) -> Exception:
    """vLLM's exceptions in tito's error model: a caller's mistake keeps its field; a bug stays a bug."""
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    cause = exc.__cause__ if isinstance(exc, EngineGenerateError) and exc.__cause__ is not None else exc
    if isinstance(cause, MultiModalCacheMissError):
        return FailedPrecondition(f"vLLM no longer holds media items {cause.mm_hashes} that were sent without "
                                  f"tensors; re-render the request with mm_payload TENSORS",
                                  reason="MM_TENSORS_REQUIRED", field="mm_features.items")
    if isinstance(cause, EngineDeadError):
        return Unavailable("vLLM's engine core exited; this replica must be restarted", reason="ENGINE_CORE_LOST")
    if isinstance(cause, VLLMValidationError):
        parameter = getattr(cause, "parameter", None)
        field = f"sampling_params.{parameter}" if parameter else None
        return InvalidArgument(f"vLLM refused the request: {cause}", reason="INVALID_SAMPLING_PARAMS"
                               if field else "INVALID_REQUEST", field=field)
    if isinstance(cause, ValueError) and "context length" in str(cause):
        return InvalidArgument(f"vLLM refused the request: {cause}", reason="PROMPT_TOO_LONG", field="token_ids")
    return exc
