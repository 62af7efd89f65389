"""vLLM KV connectors for tests, loaded by vLLM from its `--kv-transfer-config`
(`kv_connector_module_path`: this module's name, on sys.path in tests).

- `EchoConnector` moves no KV and answers each request with the `kv_transfer_params` vLLM's
  scheduler saw on it, so a test can show that the parameters a caller sends reach vLLM's
  request and that the connector's answer comes back.
- `SharedStorageEchoConnector` is vLLM's own `ExampleConnector` (it stores each new prompt's KV,
  whole blocks of all but its last token, in a shared directory keyed by the tokens, and loads it
  into an engine that meets the same prompt: KV really moves between two engines, on vLLM CPU
  too) answering as `EchoConnector` does, so one vLLM P/D pair shows both."""

from __future__ import annotations

import json
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

#: vLLM's --kv-transfer-config that loads EchoConnector on an engine.
KV_TRANSFER_CONFIG = '{"kv_connector": "EchoConnector", "kv_connector_module_path": "echo_kv_connector", ' \
                     '"kv_role": "kv_both"}'


def shared_storage_config(directory: str) -> str:
    """vLLM's --kv-transfer-config that loads SharedStorageEchoConnector over `directory`."""
    return json.dumps({"kv_connector": "SharedStorageEchoConnector", "kv_connector_module_path": "echo_kv_connector",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": directory}})


def echo(request: Any, connector: str) -> dict[str, Any] | None:
    """`connector`'s answer: what the request carried, how many prompt tokens it had and the most
    tokens it could generate (a prefill call asks for one)."""
    params = request.kv_transfer_params
    if not params:
        return None
    return {"seen": params, "prompt_tokens": request.num_prompt_tokens,
            "max_tokens": request.sampling_params.max_tokens, "connector": connector}


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
        return False, echo(request, type(self).__name__)


class SharedStorageEchoConnector(ExampleConnector):
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, echo(request, type(self).__name__)
