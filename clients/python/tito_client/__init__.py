"""tito's Python client: a chat through render -> engine -> derender, as a router runs it.

    from tito_client import AsyncChatPipeline, Endpoints
"""

from tito_client.lora import LoraAdapters
from tito_client.pipeline import AsyncChatPipeline, ChatPipeline, Endpoints, wait_until_serving
from tito_client.routing import POLICIES, EngineRouter, NoEngineAvailable

__all__ = ["AsyncChatPipeline", "ChatPipeline", "EngineRouter", "Endpoints", "LoraAdapters", "NoEngineAvailable",
           "POLICIES", "wait_until_serving"]
