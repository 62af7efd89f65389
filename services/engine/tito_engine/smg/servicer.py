"""SMG's `vllm.grpc.engine.VllmEngine` over grpc.aio, beside tito.v1's EngineService on the same
server: protos in (convert.py), the same admission and backend as tito.v1's servicer, protos out.

Errors are TitoErrors like everywhere in tito; the server's one error mapping turns them into
statuses with ErrorInfo and BadRequest, the fields named as this protocol names them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tito.errors import FailedPrecondition, InvalidArgument, LoadingGate, TitoError, Unimplemented
from tito.logs import bind_request_id

from tito_engine.backend.admission import Admission, AdmittedRequest
from tito_engine.backend.interface import EngineBackend
from tito_engine.backend.drain import Drain, draining_error
from tito_engine.backend.kv_transfers import KvTransfers, Transfer, prepare_transfer
from tito_engine.backend.observe import RequestObserver
from tito_engine.request import ChoiceOutput
from tito_engine.smg.convert import (SmgGenerate, chunk_to_proto, complete_to_proto, generate_from_proto,
                                     kv_batch_to_proto, model_info_to_proto, scheduler_load_to_proto,
                                     kv_params_json, server_info_to_proto, with_smg_fields)
from tito_engine.smg.facts import ModelFacts, read_model_facts
from tito_engine.smg.stops import RequestStops, TokenizerSource
from tito_engine.smg.stream import face_outputs
from tito_engine.smg.tokenizer_bundle import ArchiveCache

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
VERSION = "tito"
#: How often FlushCache retries a busy engine within its timeout_s.
FLUSH_RETRY_SECONDS = 0.1


class SmgEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self):
        self._backend: LoadingGate[EngineBackend] = LoadingGate("the engine")
        self._admission: Admission | None = None
        self._observer: RequestObserver | None = None
        self._model_dir = ""
        self._facts = ModelFacts()
        self._tokenizer: TokenizerSource | None = None
        self._archive: ArchiveCache | None = None
        self._started = time.time()
        self._last_receive = 0.0
        self._healthy = True
        self._drain: Drain | None = None
        self._kv: KvTransfers | None = None
        self._kv_address = ""

    def attach(self, backend: EngineBackend, admission: Admission, model_dir: Path,
               observer: RequestObserver | None = None, drain: Drain | None = None,
               kv_transfers: KvTransfers | None = None, kv_address: str = "") -> None:
        """Start answering with `backend` (the same backend, admission and drain state tito.v1's
        servicer has: a draining engine refuses new streams on both faces). `kv_transfers`: the
        prefill/decode transfers tito.v1's servicer serves too (None: refused); `kv_address`:
        where decode engines reach this engine, named in a prefill's kv_transfer_params_json."""
        self._admission = admission
        self._kv, self._kv_address = kv_transfers, kv_address
        self._drain = drain
        self._observer = observer
        self._model_dir = str(model_dir)
        self._facts = read_model_facts(Path(model_dir))
        info = backend.info
        self._tokenizer = TokenizerSource(Path(model_dir), info.tokenizer_vocab_size or info.vocab_size)
        self._archive = ArchiveCache(Path(model_dir))
        self._backend.open(backend)

    def set_healthy(self, healthy: bool) -> None:
        """HealthCheck's answer follows the model process (lost: unhealthy until it is back)."""
        self._healthy = healthy

    @property
    def _engine(self) -> EngineBackend:
        return self._backend.get()

    async def _admit(self, face: SmgGenerate) -> AdmittedRequest:
        generate = face.generate
        try:
            if generate.sampling.structured_output is not None:  # compiling a grammar can take ms: off the loop
                return await asyncio.to_thread(self._admission.admit, generate)
            return self._admission.admit(generate)
        except TitoError as error:
            raise with_smg_fields(error) from None

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context):
        if request.request_id:
            bind_request_id(request.request_id)
        self._last_receive = time.time()
        backend = self._engine
        face = generate_from_proto(request, max_context_length=backend.info.max_context_length)
        if self._drain is None:
            async for message in self._generate(backend, face):
                yield message
            return
        ticket = self._drain.enter(face.generate.request_id)  # refused at once while draining
        face = dataclasses.replace(face, generate=dataclasses.replace(face.generate, request_id=ticket.request_id))
        try:
            async for message in self._generate(backend, face):
                yield message
        finally:
            self._drain.leave(ticket)

    async def _generate(self, backend: EngineBackend, face: SmgGenerate):
        admitted = await self._admit(face)
        try:
            admitted, transfer = await prepare_transfer(backend, self._kv, face.generate, admitted)
        except TitoError as error:
            raise with_smg_fields(error) from None
        stops = None
        if face.stops is not None:
            await asyncio.to_thread(self._tokenizer.get)  # read once per engine, off the loop
            stops = RequestStops(self._tokenizer, face.stops, admitted.token_ids)
        outputs = backend.generate(admitted)
        if self._observer is not None:
            self._observer.pulled(transfer)
            outputs = self._observer.observe(outputs)
        prompt_tokens = len(admitted.token_ids)
        top = admitted.options.top_logprobs if admitted.options.logprobs else 0
        try:
            async for face_output in face_outputs(outputs, choices=admitted.options.n, stream=face.stream,
                                                  prompt_tokens=prompt_tokens, stops=stops):
                if self._drain is not None and self._drain.ended_by_drain(face_output.output):
                    raise draining_error()  # SMG retries elsewhere; the stream must not look finished
                if face.stream:
                    yield chunk_to_proto(face_output, prompt_tokens, top)
                if face_output.output.finished:
                    yield complete_to_proto(face_output, prompt_tokens, top, face.stop_token_ids,
                                            self._handoff(face_output.output, transfer, admitted.request_id))
            if stops is not None and stops.ended_a_choice and admitted.request_id:
                # Stop strings ended choices the backend still runs: abort them and wait for the
                # backend's own end, so once this stream ends the id is free and the load no
                # longer counts the request (as after a choice the backend ended itself).
                backend.abort([admitted.request_id])
                async for _ in outputs:
                    pass
        finally:
            await outputs.aclose()  # on cancel: aborts the request in the engine

    def _handoff(self, output: ChoiceOutput, transfer: Transfer | None, request_id: str) -> str | None:
        """A prefill's kv_transfer_params_json, on its last output (vLLM's connector's answer, or
        tito's handle); None otherwise."""
        if output.kv_connector_params is not None:
            return json.dumps(output.kv_connector_params, separators=(",", ":"))
        if transfer is None:
            return None
        handle = self._kv.handle_for(output, transfer, request_id)
        return kv_params_json(handle, self._kv_address) if handle is not None else None

    async def Abort(self, request: vllm_engine_pb2.AbortRequest, context):
        self._engine.abort(list(request.request_ids))
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(self, request, context):
        if not self._backend.is_open:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the engine is loading its model")
        if self._drain is not None and self._drain.draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the engine is draining before it stops")
        if not self._healthy:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the engine's model process exited")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Healthy")

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self._engine.info, self._facts, self._model_dir)

    async def GetServerInfo(self, request, context):
        backend = self._engine
        return server_info_to_proto(backend.info, backend.load(), max_running_sequences=backend.max_running_sequences,
                                    block_size=backend.kv_capacity.block_size,
                                    uptime_seconds=time.time() - self._started,
                                    last_receive_timestamp=self._last_receive,
                                    max_mm_items=self._admission.policy.max_items,
                                    largest_media_item=self._admission.largest_media_item())

    async def GetLoads(self, request: vllm_engine_pb2.GetLoadsRequest, context):
        backend = self._engine
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:  # the engine is rank 0, its only one
            loads.append(scheduler_load_to_proto(backend.load(), backend.max_running_sequences))
        return vllm_engine_pb2.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=VERSION,
                                                dp_rank_count=1, loads=loads)

    async def GetTokenizer(self, request, context):
        self._backend.get()  # UNAVAILABLE while the model loads, like every other call
        archive = await asyncio.to_thread(self._archive.get)
        chunks = archive.chunks()
        for position, data in enumerate(chunks):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=archive.sha256 if position == len(chunks) - 1 else "")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context):
        log = self._engine.kv_events
        start = request.start_sequence_number
        # 0 is "from the current state": the whole history while the log still holds it (a
        # subscriber then learns every block), else live only. A cursor resumes after a gap.
        if start == 0:
            start = 0 if log.oldest_sequence == 0 else None
        batches = log.subscribe(start)
        # Headers now, not with the first batch (which may be minutes away on an idle engine):
        # SMG takes a subscription that answers nothing for seconds for a dead worker.
        await context.send_initial_metadata(())
        event_id = 0
        try:
            async for batch in batches:
                yield kv_batch_to_proto(batch, event_id)
                event_id += len(batch.events)
        finally:
            await batches.aclose()

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context):
        timeout = request.timeout_s
        if not 0 <= timeout < float("inf"):
            raise InvalidArgument(f"timeout_s {timeout}: must be finite and >= 0", reason="INVALID_REQUEST",
                                  field="timeout_s")
        backend = self._engine
        deadline = time.monotonic() + timeout
        while True:
            try:
                await backend.reset_prefix_cache()
                return common_pb2.FlushCacheResponse(success=True, message="the prefix cache was flushed")
            except FailedPrecondition as busy:  # the vllm backend flushes only while no request holds blocks
                if time.monotonic() >= deadline:
                    return common_pb2.FlushCacheResponse(success=False, message=busy.message)
            await asyncio.sleep(FLUSH_RETRY_SECONDS)

    async def Embed(self, request, context):
        raise Unimplemented("this engine generates; it serves no embeddings", reason="RPC_UNIMPLEMENTED")

    async def StartProfile(self, request, context):
        raise Unimplemented("this engine has no profiler to start over this protocol; profile its process "
                            "with py-spy or torch's profiler", reason="RPC_UNIMPLEMENTED")

    async def StopProfile(self, request, context):
        raise Unimplemented("this engine has no profiler to stop over this protocol", reason="RPC_UNIMPLEMENTED")
