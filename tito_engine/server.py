"""Engine server: factory, CLI flags and entry point. gRPC wiring only; the work is in engine.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from tito.config import server_fields_from_args
from tito.model_paths import resolve_model
from tito.serving import RunningServer, observability, run_until_signal, start_server
from tito.startup import StartupPhases, loading_model
from tito.v1 import engine_pb2_grpc

from tito_engine.admission import Admission
from tito_engine.backend import EngineBackend
from tito_engine.config import EngineConfig
from tito_engine.engine import Engine
from tito_engine.engine_core import CoreProcessSpec
from tito_engine.features import FeaturePolicy
from tito_engine.model_runner import DEFAULT_BLOCK_SIZE, KVCacheSpec, ModelRunner, warm_up_or_warn
from tito_engine.observe import EngineMetrics, RequestObserver
from tito_engine.servicer import EngineServicer

SERVICE_NAME = "tito.v1.EngineService"

log = logging.getLogger(__name__)


VLLM_ARGS_HELP = """\
backends:
  --backend native (default) runs tito's own continuous-batching engine. --backend vllm serves the
  same EngineService with vLLM's AsyncLLM (install: bash scripts/bootstrap.sh --vllm). tito's flags
  that vLLM shares are translated: --max-running-requests (max_num_seqs), --max-model-len,
  --prefix-caching, --block-size, --max-prefill-tokens-per-step (max_num_batched_tokens),
  --kv-cache-bytes (kv_cache_memory_bytes). Every other vLLM engine argument goes after `--`, in
  vLLM's own form (see `vllm serve --help`), e.g.
    tito serve engine --backend vllm --model /models/Qwen2.5-7B-Instruct -- \\
        --tensor-parallel-size 2 --gpu-memory-utilization 0.85 --dtype bfloat16 \\
        --kv-cache-dtype fp8 --quantization fp8 --enforce-eager
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-only flags (the tito CLI adds --address, --model, --device and the other common ones)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = VLLM_ARGS_HELP
    parser.add_argument("--backend", choices=("native", "vllm"), default="native",
                        help="what runs the model: native (tito's engine, default) or vllm (vLLM's AsyncLLM; "
                             "vLLM engine arguments go after `--`, see below)")
    parser.add_argument("--max-running-requests", type=int, default=64,
                        help="most choices advanced together in one scheduler step (default 64)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="most requests queued for a slot; beyond it Generate answers RESOURCE_EXHAUSTED "
                             "(default 1024)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="per-request context limit (prompt + generated); default: the model's "
                             "max_position_embeddings")
    parser.add_argument("--max-choices-per-request", type=int, default=16,
                        help="largest n (choices per request) accepted (default 16)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV cache block (default: native 16, vLLM its platform's)")
    kv_size = parser.add_mutually_exclusive_group()
    kv_size.add_argument("--kv-blocks", type=int, default=None, help="KV cache size in blocks")
    kv_size.add_argument("--kv-cache-bytes", type=int, default=None,
                         help="KV cache size in bytes (native default on CPU: 64 MiB; vllm: kv_cache_memory_bytes)")
    kv_size.add_argument("--kv-memory-fraction", type=float, default=None,
                         help="CUDA: fraction of the memory free after loading the model given to the KV cache "
                              "(default 0.5)")
    parser.add_argument("--max-prefill-tokens-per-step", type=int, default=2048,
                        help="prompt tokens computed per step across requests; longer prompts are prefilled in "
                             "chunks beside the running decodes (default 2048)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the model and scheduler in a child process, away from the gRPC threads "
                             "(default: on; --no-engine-process keeps them on a thread of this process)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of prompt blocks shared with earlier requests (same tokens from the "
                             "start and same cache_salt); default: on")
    parser.add_argument("--exclude-padding-ids", action=argparse.BooleanOptionalAction, default=None,
                        help="never sample padding ids (embedding rows the tokenizer has no token for, e.g. Qwen's "
                             "151669..151935): native backend, default on; --no-exclude-padding-ids samples over "
                             "every row as Hugging Face and vLLM do (derender then decodes such ids as empty text)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch intra-op threads when running on CPU (default: cores - 1, at least 1)")
    media = parser.add_argument_group("media items")
    media.add_argument("--hmac-key-file", default="",
                       help="file with the HMAC key render signs media items with (render --hmac-key-file); "
                            "tags present are then verified, and signed hashes may key the encoder cache")
    media.add_argument("--hmac-key-id", default="", help="the key's id, as render puts it in auth_key_id")
    media.add_argument("--require-signed-features", action="store_true",
                       help="refuse media items without a verifying tag (needs --hmac-key-file)")
    media.add_argument("--max-mm-item-bytes", type=int, default=EngineConfig.max_mm_item_bytes,
                       help="most tensor bytes in one media item (default 64 MiB)")
    media.add_argument("--max-mm-request-bytes", type=int, default=EngineConfig.max_mm_request_bytes,
                       help="most tensor bytes in one request's media items (default 256 MiB)")
    media.add_argument("--max-mm-items", type=int, default=EngineConfig.max_mm_items,
                       help="most media items in one request (default 64)")
    media.add_argument("--encoder-cache-bytes", type=int, default=EngineConfig.encoder_cache_bytes,
                       help="bytes of encoder outputs kept for reuse and Encode (default 256 MiB; 0 = none)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        **server_fields_from_args(args),
        model=args.model,
        device=args.device,
        backend=args.backend,
        vllm_args=tuple(getattr(args, "vllm_args", ())),
        max_running_requests=args.max_running_requests,
        max_waiting_requests=args.max_waiting_requests,
        max_model_len=args.max_model_len,
        max_choices_per_request=args.max_choices_per_request,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_memory_fraction=args.kv_memory_fraction,
        max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
        cpu_threads=args.cpu_threads,
        engine_process=args.engine_process,
        prefix_caching=args.prefix_caching,
        exclude_padding_ids=args.exclude_padding_ids,
        hmac_key_file=args.hmac_key_file,
        hmac_key_id=args.hmac_key_id,
        require_signed_features=args.require_signed_features,
        max_mm_item_bytes=args.max_mm_item_bytes,
        max_mm_request_bytes=args.max_mm_request_bytes,
        max_mm_items=args.max_mm_items,
        encoder_cache_bytes=args.encoder_cache_bytes,
    )
    config.validate()
    return config


def feature_policy(config: EngineConfig) -> FeaturePolicy:
    key = config.read_hmac_key()
    return FeaturePolicy(max_item_bytes=config.max_mm_item_bytes, max_request_bytes=config.max_mm_request_bytes,
                         max_items=config.max_mm_items, signing_keys={config.hmac_key_id: key} if key else {},
                         require_signed_features=config.require_signed_features)


def _build_backend(config: EngineConfig) -> EngineBackend:
    model_dir = resolve_model(config.model)
    if config.backend == "vllm":
        from tito_engine.vllm_backend import VllmEngine
        from tito_engine.vllm_args import build_engine_args

        return VllmEngine(build_engine_args(config, str(model_dir)), model_dir, model_id=config.model,
                          max_waiting_requests=config.max_waiting_requests)
    kv_cache = KVCacheSpec(block_size=config.block_size or DEFAULT_BLOCK_SIZE, num_blocks=config.kv_blocks,
                           cache_bytes=config.kv_cache_bytes, memory_fraction=config.kv_memory_fraction)
    if config.engine_process:
        spec = CoreProcessSpec(model_dir=str(model_dir), model_id=config.model, device=config.device,
                               max_model_len=config.max_model_len, kv_cache=kv_cache, cpu_threads=config.cpu_threads,
                               max_running_sequences=config.max_running_requests,
                               max_prefill_tokens=config.max_prefill_tokens_per_step, log_level=config.log_level,
                               prefix_caching=config.prefix_caching,
                               encoder_cache_bytes=config.encoder_cache_bytes,
                               exclude_padding_ids=config.excludes_padding_ids)
        return Engine.in_process(spec, max_waiting_requests=config.max_waiting_requests)
    runner = ModelRunner(model_dir, model_id=config.model, device=config.device,
                         max_model_len=config.max_model_len, kv_cache=kv_cache, cpu_threads=config.cpu_threads,
                         exclude_padding_ids=config.excludes_padding_ids)
    warm_up_or_warn(runner)
    return Engine(runner, max_running_requests=config.max_running_requests,
                  max_waiting_requests=config.max_waiting_requests,
                  max_prefill_tokens=config.max_prefill_tokens_per_step, prefix_caching=config.prefix_caching,
                  encoder_cache_bytes=config.encoder_cache_bytes)


async def create_server(config: EngineConfig, phases: StartupPhases | None = None) -> RunningServer:
    """Start the server NOT_SERVING, load the model off the event loop, then turn SERVING."""
    phases = phases or StartupPhases()
    config.validate()
    # The port is bound (health NOT_SERVING, calls answered UNAVAILABLE) while the model loads.
    servicer = EngineServicer()
    metrics = observability(config, "engine")
    engine_metrics = EngineMetrics(metrics, servicer.load_now) if metrics is not None else None
    with phases.phase("bind"):
        running = await start_server(
            config, [SERVICE_NAME],
            lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server), metrics)
    try:
        with phases.phase("model load", "in the engine core process" if config.engine_process
                          and config.backend == "native" else config.backend):
            with loading_model(config.model):
                backend = await asyncio.to_thread(_build_backend, config)
    except BaseException:
        await running.stop(0)
        raise
    loop = asyncio.get_running_loop()

    # A dead model process cannot come back: tell load balancers to stop sending work here.
    backend.on_core_lost = lambda: asyncio.run_coroutine_threadsafe(running.set_not_serving(), loop)
    backend.on_core_restored = lambda: asyncio.run_coroutine_threadsafe(running.set_serving(), loop)
    with phases.phase("core start"):
        backend.start()
    running.add_cleanup(lambda: asyncio.to_thread(backend.stop))
    admission = Admission.for_backend(backend, feature_policy(config), config.max_choices_per_request)
    observer = RequestObserver(engine_metrics)
    servicer.attach(backend, admission, observer if observer.active else None)
    await running.set_serving()
    phases.serving()
    if config.hmac_key_file:
        log.info("media item tags are verified (key id %r); unsigned items are %s", config.hmac_key_id,
                 "refused" if config.require_signed_features else "accepted but not trusted for cache hits")
    return running


async def serve(config: EngineConfig, phases: StartupPhases | None = None) -> None:
    running = await create_server(config, phases)
    await run_until_signal(running)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m tito_engine.server ...`): exactly `tito serve engine ...`."""
    from tito.cli import main as tito_main

    return tito_main(["serve", "engine", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
