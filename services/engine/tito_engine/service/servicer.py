"""tito.v1.EngineService over grpc.aio: protos in, domain calls, protos out. Nothing else.

Every request passes the same admission (backend/admission.py) and then goes to the backend seam
(backend/interface.py): the native engine or vLLM, which cannot tell the servicer apart. Every Generate
stream is known to the drain state (backend/drain.py), which refuses new ones while draining and ends the
ones the grace period did not see finish as "engine gone".
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable

from tito.errors import FailedPrecondition, InvalidArgument, LoadingGate
from tito.logs import bind_request_id
from tito.v1 import engine_pb2, engine_pb2_grpc

from tito_engine.backend.admission import Admission
from tito_engine.backend.drain import Drain, draining_error
from tito_engine.backend.interface import EngineBackend, LoadSnapshot
from tito_engine.backend.kv_transfers import (PROTOCOL_VLLM_CONNECTOR, KvTransfers, prepare_transfer,
                                              transfer_protocol)
from tito_engine.backend.observe import RequestObserver
from tito_engine.kv_transfer import TRANSFER_UNSUPPORTED, block_checksum
from tito_engine.service.convert import (KV_TRANSFER_PROTOCOLS, MODALITIES, descriptor_to_proto,
                                         generate_input_from_proto, handle_from_proto, kv_batch_to_proto,
                                         lora_adapter_to_proto, media_from_proto, output_to_proto)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self):
        self._backend: LoadingGate[EngineBackend] = LoadingGate("the engine")
        self._admission: Admission | None = None
        self._observer: RequestObserver | None = None
        self._kv: KvTransfers | None = None  # prefill/decode transfers (None: refused, as by the vllm backend)
        self.drain_state = Drain(lambda request_ids: self._engine.abort(request_ids))
        self._drain_grace = 0.0
        self._on_drain: Callable[[], Awaitable[None]] | None = None

    def attach(self, backend: EngineBackend, admission: Admission, observer: RequestObserver | None = None,
               kv_transfers: KvTransfers | None = None) -> None:
        """Start answering with `backend` (the server is bound before the model finishes loading);
        `observer` measures and traces each Generate stream (None: metrics and tracing are off);
        `kv_transfers` serves prefill/decode roles and PullKvBlocks."""
        self._admission = admission
        self._observer = observer
        self._kv = kv_transfers
        self._backend.open(backend)

    def on_drain(self, grace_seconds: float, announce: Callable[[], Awaitable[None]]) -> None:
        """Drain's default grace period, and what tells the world (health NOT_SERVING)."""
        self._drain_grace = grace_seconds
        self._on_drain = announce

    async def drain(self, grace_seconds: float | None = None) -> int:
        """Start draining (drain.py); return the streams in flight."""
        in_flight = self.drain_state.start(self._drain_grace if grace_seconds is None else grace_seconds)
        if self._on_drain is not None:
            await self._on_drain()
        return in_flight

    def load_now(self) -> LoadSnapshot | None:
        """The backend's load, or None while the model loads (for metrics read at scrape time)."""
        return self._backend.get().load() if self._backend.is_open else None

    @property
    def _engine(self) -> EngineBackend:
        return self._backend.get()

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        if request.request_id:
            bind_request_id(request.request_id)
        backend = self._engine
        ticket = self.drain_state.enter(request.request_id)  # refused at once while draining
        try:
            generate = dataclasses.replace(generate_input_from_proto(request), request_id=ticket.request_id)
            if generate.sampling.structured_output is not None:  # checking a grammar can take ms: off the loop
                admitted = await asyncio.to_thread(self._admission.admit, generate)
            else:
                admitted = self._admission.admit(generate)
            admitted, transfer = await prepare_transfer(backend, self._kv, generate, admitted)
            outputs = backend.generate(admitted)
            if self._observer is not None:
                self._observer.pulled(transfer)
                outputs = self._observer.observe(outputs)
            try:
                async for output in outputs:
                    if self.drain_state.ended_by_drain(output):
                        if output.token_ids:  # what it made before the abort: the router continues after it
                            yield output_to_proto(dataclasses.replace(output, finish_reason=None, usage=None))
                        raise draining_error()
                    if transfer is None:
                        yield output_to_proto(output)
                    else:
                        yield output_to_proto(self._kv.with_stats(output, transfer),
                                              self._kv.handle_for(output, transfer, ticket.request_id))
            finally:
                await outputs.aclose()  # on cancel: aborts the request in the engine
        finally:
            self.drain_state.leave(ticket)

    async def PullKvBlocks(self, request: engine_pb2.PullKvBlocksRequest, context):
        export = await self._kv_transfers().export(handle_from_proto(request.handle), request.first_block)
        for offset, data in enumerate(export.blocks):
            yield engine_pb2.PullKvBlocksResponse(block_index=export.first_block + offset, data=data,
                                                  byte_size=len(data), checksum=block_checksum(data))

    def _kv_transfers(self) -> KvTransfers:
        self._backend.get()  # UNAVAILABLE while the model loads
        if self._kv is None:
            raise FailedPrecondition("this engine does not transfer KV (prefill/decode disaggregation needs "
                                     "--backend native)", reason=TRANSFER_UNSUPPORTED, field="kv_transfer")
        return self._kv

    async def Encode(self, request: engine_pb2.EncodeRequest, context):
        if request.request_id:
            bind_request_id(request.request_id)
        backend = self._engine
        descriptors = await backend.encode(self._admission.admit_encode(media_from_proto(request)))
        return engine_pb2.EncodeResponse(
            descriptors=[descriptor_to_proto(d) for d in self._admission.sign_descriptors(descriptors)])

    async def Abort(self, request: engine_pb2.AbortRequest, context):
        return engine_pb2.AbortResponse(aborted_request_ids=self._engine.abort(list(request.request_ids)))

    async def GetModelInfo(self, request, context):
        backend = self._engine
        info = backend.info
        adapters = await backend.list_lora_adapters() if backend.max_loras else ()
        protocol = transfer_protocol(backend, self._kv)
        return engine_pb2.EngineServiceGetModelInfoResponse(
            lora_adapters=[lora_adapter_to_proto(adapter) for adapter in adapters],
            max_loras=backend.max_loras, max_lora_rank=backend.max_lora_rank,
            kv_transfer_protocol=KV_TRANSFER_PROTOCOLS[protocol],
            kv_connector=backend.kv_connector_name if protocol == PROTOCOL_VLLM_CONNECTOR else "",
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            max_context_length=info.max_context_length,
            eos_token_ids=info.eos_token_ids,
            dtype=info.dtype,
            device=info.device,
            model_fingerprint=info.fingerprint,
            max_running_requests=self._engine.max_running_sequences,
            tokenizer_vocab_size=info.tokenizer_vocab_size or info.vocab_size,
            modalities=[engine_pb2.ModalityInfo(modality=MODALITIES[name], placeholder_token=token,
                                                placeholder_token_id=token_id)
                        for name, token, token_id in info.placeholders if name in MODALITIES],
        )

    async def GetLoad(self, request, context):
        load = self._engine.load()
        return engine_pb2.GetLoadResponse(
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            finished_requests=load.finished_requests,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_used=load.kv_blocks_used,
            kv_block_size=load.kv_block_size,
            prefix_cache_hit_tokens=load.prefix_cache_hit_tokens,
            encoder_cache_hits=load.encoder_cache_hits,
            encoder_cache_misses=load.encoder_cache_misses,
            encoded_items=load.encoded_items,
            encoder_store_loads=load.encoder_store_loads,
            draining=self.drain_state.draining,
            lora_adapters=[lora_adapter_to_proto(adapter) for adapter in load.lora_adapters],
        )

    async def Drain(self, request: engine_pb2.DrainRequest, context):
        grace = request.grace_seconds if request.HasField("grace_seconds") else None
        if grace is not None and not (math.isfinite(grace) and grace >= 0):
            raise InvalidArgument(f"grace_seconds must be a finite number >= 0, got {grace}", reason="INVALID_DRAIN",
                                  field="grace_seconds")
        return engine_pb2.DrainResponse(in_flight_requests=await self.drain(grace))

    async def SubscribeKvEvents(self, request: engine_pb2.SubscribeKvEventsRequest, context):
        start = request.start_sequence if request.HasField("start_sequence") else None
        batches = self._engine.kv_events.subscribe(start)
        try:
            async for batch in batches:
                yield kv_batch_to_proto(batch)
        finally:
            await batches.aclose()

    async def ResetPrefixCache(self, request, context):
        await self._engine.reset_prefix_cache()
        return engine_pb2.ResetPrefixCacheResponse()

    async def LoadLoraAdapter(self, request: engine_pb2.LoadLoraAdapterRequest, context):
        adapter = await self._engine.load_lora_adapter(request.lora_name, request.lora_path)
        return engine_pb2.LoadLoraAdapterResponse(adapter=lora_adapter_to_proto(adapter))

    async def UnloadLoraAdapter(self, request: engine_pb2.UnloadLoraAdapterRequest, context):
        active = await self._engine.unload_lora_adapter(request.lora_name)
        return engine_pb2.UnloadLoraAdapterResponse(active_requests=active)

    async def ListLoraAdapters(self, request, context):
        adapters = await self._engine.list_lora_adapters()
        return engine_pb2.ListLoraAdaptersResponse(adapters=[lora_adapter_to_proto(adapter) for adapter in adapters])
