"""The shared bootstrap: error mapping, health, reflection, unix sockets, graceful stop."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tito.config import ConfigError, ServerConfig
from tito.errors import InvalidArgument
from tito.grpc_errors import error_details
from tito.serving import start_server
from tito.v1 import derender_pb2, derender_pb2_grpc

SERVICE = "tito.v1.DerenderService"


class _Servicer(derender_pb2_grpc.DerenderServiceServicer):
    async def Detokenize(self, request, context):
        if not request.token_ids:
            raise InvalidArgument("token_ids: must not be empty", reason="EMPTY", field="token_ids")
        if request.token_ids[0] == 13:
            raise RuntimeError("secret internal detail")
        return derender_pb2.DetokenizeResponse(text=str(list(request.token_ids)))

    async def Derender(self, request_iterator, context):
        async for request in request_iterator:
            if request.HasField("context"):
                yield derender_pb2.DerenderResponse(chunk=derender_pb2.ChatChunk(content="ctx"))
            else:
                raise InvalidArgument("generate_response: boom", reason="BOOM", field="generate_response")


def _factory(address="127.0.0.1:0", serving=True):
    async def make():
        running = await start_server(
            ServerConfig(address=address), [SERVICE],
            lambda server: derender_pb2_grpc.add_DerenderServiceServicer_to_server(_Servicer(), server))
        if serving:
            await running.set_serving()
        return running
    return make


def test_domain_errors_map_to_rich_status_and_server_keeps_serving(aio_server):
    server = aio_server(_factory())
    with server.channel() as channel:
        stub = derender_pb2_grpc.DerenderServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Detokenize(derender_pb2.DetokenizeRequest(), timeout=5)
        details = error_details(info.value)
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
        assert details["reason"] == "EMPTY" and details["fields"] == ["token_ids"]
        with pytest.raises(grpc.RpcError) as info:
            stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[13]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in info.value.details()  # internals stay in the log, not on the wire
        assert stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[1, 2]), timeout=5).text == "[1, 2]"


def test_streaming_errors_arrive_as_status_after_earlier_messages(aio_server):
    server = aio_server(_factory())
    with server.channel() as channel:
        stub = derender_pb2_grpc.DerenderServiceStub(channel)
        requests = [derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext()),
                    derender_pb2.DerenderRequest(generate_response={})]
        call = stub.Derender(iter(requests), timeout=5)
        assert next(call).chunk.content == "ctx"
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert error_details(info.value)["fields"] == ["generate_response"]


def test_health_and_reflection(aio_server):
    server = aio_server(_factory(serving=False))
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        server.call(server.running.set_serving)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5)
        names = {s.name for s in next(replies).list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_unix_socket(aio_server, tmp_path):
    server = aio_server(_factory(address=f"unix:{tmp_path / 'd.sock'}"))
    with grpc.insecure_channel(server.address) as channel:
        stub = derender_pb2_grpc.DerenderServiceStub(channel)
        assert stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[7]), timeout=5).text == "[7]"


def test_stop_turns_health_not_serving_and_refuses_new_calls(aio_server):
    server = aio_server(_factory())
    channel = server.channel()
    stub = derender_pb2_grpc.DerenderServiceStub(channel)
    assert stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[1]), timeout=5).text == "[1]"
    server.call(lambda: server.running.stop(0.5))
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[1]), timeout=2)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    channel.close()


def test_an_address_in_use_is_a_config_error_not_a_traceback(aio_server, tmp_path):
    server = aio_server(_factory())
    with pytest.raises(ConfigError, match="in use"):
        aio_server(_factory(address=server.address))
    with pytest.raises(ConfigError, match="cannot create the socket"):
        aio_server(_factory(address=f"unix:{tmp_path / 'missing' / 'x.sock'}"))
