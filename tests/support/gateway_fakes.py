"""A fake of the three services behind the gateway, faithful where the gateway's tests need it:
each request crosses the protobuf wire as it would on its way to render."""

from __future__ import annotations

from tito.v1 import derender_pb2, engine_pb2, render_pb2

SERVED = "served-model"
SERVING = {"render": "SERVING", "engine": "SERVING", "derender": "SERVING"}


class FakeRender:
    """Render's GetModelInfo, as the gateway calls it."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    async def GetModelInfo(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        return render_pb2.RenderServiceGetModelInfoResponse(model_id=self.model_id, max_context_length=4096)


class FakePipeline:
    """What the gateway uses of AsyncChatPipeline. Each request is serialized and parsed back, as
    gRPC carries it to render (so what protobuf cannot encode or decode fails here as it would
    there), kept in `requests`, and answered with one finished chunk per choice."""

    def __init__(self, model_id: str) -> None:
        self.render = FakeRender(model_id)
        self._metadata = ()
        self.requests: list = []

    async def stream_chat(self, request, on_generating=None):
        self.requests.append(type(request).FromString(request.SerializeToString()))
        if on_generating is not None:
            on_generating()
        for index in range(max(1, request.sampling.n)):
            yield derender_pb2.ChatChunk(index=index, role="assistant", content="ok",
                                         finish_reason=engine_pb2.FINISH_REASON_STOP,
                                         usage=engine_pb2.Usage(prompt_tokens=3, completion_tokens=1))

    stream_completion = stream_chat


class FakeUpstream:
    """Upstream's face: the pipeline, each service's health (`states`, settable) and the engines'
    LoRA adapters (`adapters`, names; `adapter_lists` counts the times they were asked for)."""

    def __init__(self, model_id: str) -> None:
        self.pipeline = FakePipeline(model_id)
        self.states = dict(SERVING)
        self.adapters: list[str] = []
        self.adapter_lists = 0

    async def lora_adapters(self) -> list[engine_pb2.LoraAdapterInfo]:
        self.adapter_lists += 1
        return [engine_pb2.LoraAdapterInfo(name=name, path=f"adapters/{name}") for name in self.adapters]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.adapters.append(name)

    async def unload_lora_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    async def health(self) -> dict[str, str]:
        return dict(self.states)
