"""Engine server: factory, CLI flags and entry point. gRPC wiring only; the work is in engine.py.

One server, two protocol faces on the same port over one backend: tito.v1's EngineService and
SMG's vllm.grpc.engine.VllmEngine (tito_engine/smg/), both listed by health and reflection."""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid

from tito import settings
from tito_models.paths import resolve_model
from tito.serving import RunningServer, observability, run_until_signal, start_server
from tito.security import ClientSecurity
from tito.settings import add_settings
from tito.startup import StartupPhases, loading_model
from tito.v1 import engine_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2_grpc

from tito_engine.backend.admission import Admission
from tito_engine.backend.interface import EngineBackend
from tito_engine.config import EngineConfig
from tito_engine.core.engine import Engine
from tito_engine.multimodal.features import FeaturePolicy
from tito_engine.model.runner import warm_up_or_warn
from tito_engine.model_info import check_checkpoint
from tito_engine.backend.kv_transfers import KvTransfers
from tito_engine.backend.observe import EngineMetrics, RequestObserver
from tito_engine.kv_transfer import HandleIssuer
from tito_engine.service.kv_peer import KvPeers
from tito_engine.service.servicer import EngineServicer
from tito_engine.smg.servicer import SERVICE_NAME as SMG_SERVICE_NAME, SmgEngineServicer
from tito_engine.startup_plan import StartupPlan, plan_startup

SERVICE_NAME = "tito.v1.EngineService"

log = logging.getLogger(__name__)


VLLM_ARGS_HELP = """\
backends:
  --backend native (default) runs tito's own continuous-batching engine. --backend vllm serves the
  same EngineService with vLLM's AsyncLLM (install: bash scripts/bootstrap.sh --vllm). tito's flags
  that vLLM shares are translated: --max-running-sequences (max_num_seqs), --max-model-len,
  --prefix-caching, --block-size, --max-prefill-tokens-per-step (max_num_batched_tokens),
  --kv-cache-bytes (kv_cache_memory_bytes), --dtype (dtype). Every other vLLM engine argument
  goes after `--`, in vLLM's own form (see `vllm serve --help`), e.g.
    tito serve engine --backend vllm --model /models/Qwen2.5-7B-Instruct --dtype bfloat16 -- \\
        --tensor-parallel-size 2 --gpu-memory-utilization 0.85 \\
        --kv-cache-dtype fp8 --quantization fp8 --enforce-eager
"""


#: The typed config whose field declarations give this service's flags (tito.settings).
CONFIG = EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-only flags (the tito CLI adds --address, --model, --device and the other common ones)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = VLLM_ARGS_HELP
    add_settings(parser, EngineConfig, common=False)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config of a parsed command line; what follows `--` is vLLM's (args.vllm_args). The model's
    files are checked here, before anything is logged, bound or loaded."""
    config = settings.config_from_args(EngineConfig, args, vllm_args=tuple(getattr(args, "vllm_args", ())))
    if config.model:  # (validate says what an empty one means)
        check_checkpoint(resolve_model(config.model), config.model)  # before validate imports vLLM
    config.validate()
    return config


def feature_policy(config: EngineConfig) -> FeaturePolicy:
    key = config.read_hmac_key()
    return FeaturePolicy(max_item_bytes=config.max_mm_item_bytes, max_request_bytes=config.max_mm_request_bytes,
                         max_items=config.max_mm_items, signing_keys={config.hmac_key_id: key} if key else {},
                         require_signed_features=config.require_signed_features)


def _build_backend(config: EngineConfig, plan: StartupPlan | None) -> EngineBackend:
    """The backend the config names, loaded (`plan`: made here when the caller made none)."""
    plan = plan or plan_startup(config)
    if config.backend == "vllm":
        from tito_engine.vllm.backend import VllmEngine
        from tito_engine.vllm.args import build_engine_args

        return VllmEngine(build_engine_args(config, str(plan.model_dir)), plan.model_dir, model_id=config.model,
                          max_waiting_requests=config.max_waiting_requests, kv_event_buffer=config.kv_events_buffer,
                          kv_flag_given=config.kv_cache_bytes is not None, lora_dir=config.lora_dir,
                          lora_modules=config.lora_module_pairs())
    spec = plan.core_spec(config)
    if config.engine_process:
        return Engine.in_process(spec, max_waiting_requests=config.max_waiting_requests,
                                 kv_event_buffer=config.kv_events_buffer)
    runner = spec.load_runner()  # the same spec, loaded on a thread of this process
    warm_up_or_warn(runner, spec.limits.max_prefill_tokens)
    return Engine(runner, limits=spec.limits, max_waiting_requests=config.max_waiting_requests,
                  encoder_cache_bytes=spec.encoder_cache_bytes, encoder_store_dir=spec.encoder_store_dir,
                  encoder_store_bytes=spec.encoder_store_bytes, kv_event_buffer=config.kv_events_buffer,
                  lora_dir=spec.lora_dir, lora_modules=spec.lora_modules)


async def create_server(config: EngineConfig, phases: StartupPhases | None = None,
                        plan: StartupPlan | None = None) -> RunningServer:
    """Start the server NOT_SERVING, load the model off the event loop, then turn SERVING. `plan`:
    the start-up plan `serve` made (None: it is made here, with the model's load)."""
    phases = phases or StartupPhases()
    config.validate()
    # The port is bound (health NOT_SERVING, calls answered UNAVAILABLE) while the model loads.
    servicer = EngineServicer()
    smg_servicer = SmgEngineServicer()
    metrics = observability(config, "engine")
    engine_metrics = EngineMetrics(metrics, servicer.load_now) if metrics is not None else None

    def register(server) -> None:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(smg_servicer, server)

    with phases.phase("bind"):
        running = await start_server(config, [SERVICE_NAME, SMG_SERVICE_NAME], register, metrics)
    try:
        with phases.phase("model load", "in the engine core process" if config.engine_process
                          and config.backend == "native" else config.backend):
            with loading_model(config.model):
                backend = await asyncio.to_thread(_build_backend, config, plan)
    except BaseException:
        await running.stop(0)
        raise
    loop = asyncio.get_running_loop()

    # A dead model process cannot come back: tell load balancers to stop sending work here.
    def core_lost() -> None:
        smg_servicer.set_healthy(False)
        asyncio.run_coroutine_threadsafe(running.set_not_serving(), loop)

    def core_restored() -> None:
        # A draining engine stays NOT_SERVING on both faces: the restart does not undo the drain.
        if servicer.drain_state.draining:
            return
        smg_servicer.set_healthy(True)
        asyncio.run_coroutine_threadsafe(running.set_serving(), loop)

    backend.on_core_lost = core_lost
    backend.on_core_restored = core_restored
    with phases.phase("core start"):
        backend.start()
    running.add_cleanup(lambda: asyncio.to_thread(backend.stop))
    running.add_closer(backend.kv_events.close)  # SubscribeKvEvents streams end as shutdown begins
    if config.kv_events_endpoint:
        from tito_engine.kv_publisher import ZmqKvEventPublisher  # pyzmq: only when asked for

        publisher = ZmqKvEventPublisher(backend.kv_events, config.kv_events_endpoint,
                                        config.kv_events_replay_endpoint or None, topic=config.kv_events_topic,
                                        public=config.kv_events_public, int_hashes=config.kv_events_int_hashes)
        publisher.start()
        running.endpoints["kv_events"] = publisher.endpoint  # where it bound (port 0: the OS's choice)
        if publisher.replay_endpoint:
            running.endpoints["kv_events_replay"] = publisher.replay_endpoint
        running.add_cleanup(lambda: asyncio.to_thread(publisher.stop))
    admission = Admission.for_backend(backend, feature_policy(config), config.max_choices_per_request)
    observer = RequestObserver(engine_metrics)
    kv_transfers = _kv_transfers(config, backend, running)
    servicer.attach(backend, admission, observer if observer.active else None, kv_transfers)
    smg_servicer.attach(backend, admission, plan.model_dir if plan else resolve_model(config.model),
                        observer if observer.active else None, drain=servicer.drain_state, kv_transfers=kv_transfers,
                        kv_address=config.kv_peer_address or running.address)
    servicer.on_drain(config.grace_seconds, running.set_not_serving)
    running.add_drainer(lambda grace: _drain_before_stop(servicer, grace))
    await running.set_serving()
    phases.serving()
    if config.hmac_key_file:
        log.info("media item tags are verified (key id %r); unsigned items are %s", config.hmac_key_id,
                 "refused" if config.require_signed_features else "accepted but not trusted for cache hits")
    return running


def _kv_transfers(config: EngineConfig, backend: EngineBackend, running: RunningServer) -> KvTransfers | None:
    """Prefill/decode transfers of the native backend: handles signed with the media HMAC key
    (--hmac-key-file) when there is one, pins bounded by --kv-pin-seconds, pulls from other
    engines with this engine's token (and TLS with --kv-peer-tls-ca-file)."""
    if config.backend != "native":
        return None
    issuer = HandleIssuer(f"engine-{uuid.uuid4().hex[:16]}", backend.info.fingerprint,
                          feature_policy(config).signing_keys, config.kv_pin_seconds)
    peers = KvPeers(ClientSecurity(ca_file=config.kv_peer_tls_ca_file, token_file=config.auth_token_file))
    running.add_cleanup(peers.close)
    return KvTransfers(backend, issuer, peers)


async def _drain_before_stop(servicer: EngineServicer, grace_seconds: float) -> None:
    """SIGTERM: drain (drain.py); the streams the grace period did not see finish end as "engine
    gone" at its end, a moment later they have left, and then the server stops."""
    in_flight = await servicer.drain(grace_seconds)
    if in_flight:
        log.info("draining: %d requests in flight, %.1fs to finish", in_flight, grace_seconds)
    if not await servicer.drain_state.wait_idle(grace_seconds + 5.0):
        log.warning("draining: %d requests still in flight after the grace period", servicer.drain_state.in_flight)


async def serve(config: EngineConfig, phases: StartupPhases | None = None) -> None:
    """Serve until SIGTERM/SIGINT, this process on the CPUs the engine core leaves (--core-cpus):
    the start-up plan is made once, here, and the core gets the CPUs of the same plan."""
    plan = plan_startup(config)
    if plan.cpus is not None:
        log.info("engine on CPU: %s", plan.cpus.describe())
        if plan.cpus.server_cpus is not None:
            from tito.cpu_affinity import run_on

            run_on(plan.cpus.server_cpus)
    running = await create_server(config, phases, plan)
    await run_until_signal(running)
