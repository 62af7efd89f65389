"""Prefill/decode disaggregation at the service edge (the story: tito_engine/kv_transfer.py).

- prefill: the request runs to its first token (max_tokens and n taken as 1) with a pin order;
  its last output's `KvPinned` becomes a handle (`handle_for`).
- decode: the handle is checked (signature, model, prompt), the prefix cache is asked which
  leading blocks it holds, the rest are pulled from the prefilling engine (kv_peer.py), and the
  request goes to the core with them; its choice 0's last output carries what the pull took.
  When the prefilling engine cannot be reached (or sends damaged blocks), the request is
  prefilled here instead: slower, never lost. A handle it refuses stays refused.
- PullKvBlocks: the handle is checked, the core hands the pinned blocks out once.

`prepare_transfer` is where both protocol faces start: a backend whose KV moves through vLLM's
own connector (the vllm backend) takes vLLM's kv_transfer_params as they came; the native
backend takes the typed role.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from tito import kv_params
from tito.errors import FailedPrecondition, Unavailable

from tito_engine.kv_transfer import (TRANSFER_MISMATCH, TRANSFER_UNSUPPORTED, HandleIssuer, ImportedKv, KvDecode,
                                     KvExport, KvHandle, KvPrefill, TransferStats, prompt_digest)
from tito_engine.request import ChoiceOutput, GenerateInput
from tito_engine.scheduling.blocks import blocks_for_tokens
from tito_engine.backend.admission import AdmittedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """One request's part in a transfer, from admission to its last output."""

    request_id: str
    digest: bytes
    stats: TransferStats | None = None  # decode: what was pulled


async def prepare_transfer(backend: Any, transfers: "KvTransfers | None", generate: GenerateInput,
                           admitted: AdmittedRequest) -> tuple[AdmittedRequest, "Transfer | None"]:
    """The admitted request as `backend` takes it for its part in a prefill/decode split, and the
    native transfer it starts (None: no part, or vLLM's connector moves the KV)."""
    if getattr(backend, "kv_connector", False):
        if generate.kv_connector_params is not None:
            return dataclasses.replace(admitted, kv_connector_params=generate.kv_connector_params), None
        if generate.kv_transfer is not None:
            raise unsupported("this engine's KV moves through vLLM's connector (--backend vllm): send vLLM's "
                              "kv_transfer_params (kv_transfer.connector_params_json), not a tito role")
        return admitted, None
    if generate.kv_transfer is None:
        refusal = kv_params.foreign_decode(generate.kv_connector_params or {})
        if refusal is not None:
            raise refusal
        return admitted, None
    if transfers is None:
        raise unsupported("this engine does not transfer KV")
    return await transfers.prepare(generate, admitted)


#: How an engine takes part in a prefill/decode split (GetModelInfo's kv_transfer_protocol), so
#: a router pairs a prefill engine only with a decode engine that speaks the same.
PROTOCOL_NONE, PROTOCOL_TITO, PROTOCOL_VLLM_CONNECTOR = "none", "tito", "vllm_connector"


def transfer_protocol(backend: Any, transfers: "KvTransfers | None") -> str:
    """`backend`'s protocol: vLLM's connector when --kv-transfer-config configured one, tito's
    own transfers when the engine serves them, else none."""
    if getattr(backend, "kv_connector", False):
        return PROTOCOL_VLLM_CONNECTOR if backend.kv_connector_name else PROTOCOL_NONE
    return PROTOCOL_TITO if transfers is not None else PROTOCOL_NONE


def unsupported(why: str) -> FailedPrecondition:
    return FailedPrecondition(why, reason=TRANSFER_UNSUPPORTED, field="kv_transfer")


class KvTransfers:
    def __init__(self, backend: Any, issuer: HandleIssuer, peers: Any):
        self.backend = backend
        self.issuer = issuer
        self.peers = peers  # kv_peer.KvPeers

    async def prepare(self, generate: GenerateInput, admitted: AdmittedRequest
                      ) -> tuple[AdmittedRequest, Transfer]:
        """The admitted request as the backend takes it for its role, and its transfer."""
        self._check_supported()
        digest = prompt_digest(admitted.token_ids, admitted.cache_salt, admitted.lora_name,
                               [item.mm_hash for item in generate.mm_items])
        role = generate.kv_transfer
        if isinstance(role, KvPrefill):
            options = dataclasses.replace(admitted.options, max_tokens=1, n=1)
            return (dataclasses.replace(admitted, options=options, kv_pin=self.issuer.pin_order(role)),
                    Transfer(admitted.request_id, digest))
        assert isinstance(role, KvDecode)
        return await self._pull(admitted, role, digest)

    async def _pull(self, admitted: AdmittedRequest, role: KvDecode, digest: bytes
                    ) -> tuple[AdmittedRequest, Transfer]:
        handle = role.handle
        self.issuer.check_decode(handle, digest)
        block_size = self.backend.kv_capacity.block_size
        if handle.block_size != block_size or handle.block_count != blocks_for_tokens(len(admitted.token_ids),
                                                                                        block_size):
            raise FailedPrecondition(f"the handle's blocks ({handle.block_count} of {handle.block_size} tokens) do not "
                                     f"fit this engine's cache ({block_size}-token blocks) for this prompt",
                                     reason=TRANSFER_MISMATCH, field="kv_transfer.decode.handle.block_size")
        cached = 0
        # Text prompts, under an adapter or not, skip what the prefix cache holds. Media prompts
        # pull from block 0: an import that starts there is never dropped (the cache cannot lose
        # blocks it did not give), so the decode engine never needs its encoder for them
        # (kv_export.covers_media).
        if not admitted.features:
            cached = min(await self.backend.cached_prompt_blocks(admitted.token_ids, admitted.cache_salt,
                                                                 admitted.lora_name), handle.block_count)
        try:
            blocks = await self.peers.pull(role.source_address, handle, cached)
        except Unavailable as exc:  # the prefilling engine is gone or sent damage: compute the prompt here
            log.warning("pulling KV from %s failed (%s); prefilling here instead", role.source_address, exc.message,
                        extra={"request_id": admitted.request_id})
            return admitted, Transfer(admitted.request_id, digest, TransferStats(0, cached, 0))
        stats = TransferStats(len(blocks), cached, sum(len(block) for block in blocks))
        return (dataclasses.replace(admitted, kv_import=ImportedKv(cached, tuple(blocks))),
                Transfer(admitted.request_id, digest, stats))

    def handle_for(self, output: ChoiceOutput, transfer: Transfer, request_id: str) -> KvHandle | None:
        """The handle of a prefill request's pinned KV, on its last output."""
        if output.kv_pinned is None:
            return None
        return self.issuer.issue(output.kv_pinned, request_id, transfer.digest)

    @staticmethod
    def with_stats(output: ChoiceOutput, transfer: Transfer) -> ChoiceOutput:
        """A decode request's choice 0 last output, with what the pull took."""
        if transfer.stats is None or output.index != 0 or output.finish_reason is None:
            return output
        return dataclasses.replace(output, kv_stats=transfer.stats)

    async def export(self, handle: KvHandle, first_block: int) -> KvExport:
        """PullKvBlocks: the handle checked here, the blocks handed out once by the core."""
        self._check_supported()
        self.issuer.check_pull(handle)
        return await self.backend.export_kv(handle.transfer_id, first_block, handle.block_count, handle.num_tokens)

    def _check_supported(self) -> None:
        if not hasattr(self.backend, "export_kv"):
            raise FailedPrecondition("this engine's backend does not transfer KV (prefill/decode disaggregation "
                                     "needs --backend native)", reason=TRANSFER_UNSUPPORTED, field="kv_transfer")

