"""A vLLM KV connector that moves no KV and answers each request with the `kv_transfer_params`
vLLM's scheduler saw on it, so a test can show that the parameters a caller sends reach vLLM's
request and that the connector's answer comes back. Loaded by vLLM from its
`--kv-transfer-config` (`kv_connector_module_path`: this module's name, on sys.path in tests)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

#: vLLM's --kv-transfer-config that loads this connector on an engine.
KV_TRANSFER_CONFIG = '{"kv_connector": "EchoConnector", "kv_connector_module_path": "echo_kv_connector", ' \
                     '"kv_role": "kv_both"}'


class EchoConnector(KVConnectorBase_V1):
    """Every worker-side hook does nothing; the scheduler side reports no external KV."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The answer: what the request carried, and how many prompt tokens it had."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        return False, {"seen": params, "prompt_tokens": request.num_prompt_tokens, "connector": "EchoConnector"}
