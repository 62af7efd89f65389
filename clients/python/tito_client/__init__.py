"""tito's Python client: a chat through render -> engine -> derender, as a router runs it.

    from tito_client import AsyncChatPipeline, Endpoints
"""

from tito_client.engine_stream import AsyncMigratingStream, MigratingStream
from tito_client.lora import LoraAdapters
from tito_client.pipeline import AsyncChatPipeline, ChatPipeline, Endpoints, wait_until_serving
from tito_client.routing import POLICIES, EngineRouter, NoEngineAvailable

__all__ = ["AsyncChatPipeline", "AsyncMigratingStream", "ChatPipeline", "EngineRouter", "Endpoints", "LoraAdapters",
           "MigratingStream", "NoEngineAvailable", "POLICIES", "wait_until_serving"]
