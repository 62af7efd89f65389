"""tito's OpenAI-compatible HTTP gateway: each request through render -> engine -> derender with
tito's asyncio client (tito_client.AsyncChatPipeline), answered in OpenAI's JSON and SSE shapes."""
