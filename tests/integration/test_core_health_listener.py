"""--health-address: a second, plaintext listener with the health service alone, mirroring the
main one's status (for probes that speak neither TLS nor Unix sockets)."""

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tito.config import ConfigError, ServerConfig
from tito.serving import start_server
from tito.v1 import derender_pb2, derender_pb2_grpc

SERVICE = "tito.v1.DerenderService"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=10).status


def test_the_health_listener_mirrors_the_server_and_serves_nothing_else(aio_server, tmp_path):
    health_address = f"127.0.0.1:{_free_port()}"
    config = ServerConfig(address=f"unix:{tmp_path / 'd.sock'}", health_address=health_address)

    def register(server):
        derender_pb2_grpc.add_DerenderServiceServicer_to_server(derender_pb2_grpc.DerenderServiceServicer(), server)

    async def make():
        return await start_server(config, [SERVICE], register)

    server = aio_server(make)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _status(health_address) == not_serving and _status(health_address, SERVICE) == not_serving
    server.call(server.running.set_serving)
    assert _status(health_address) == serving and _status(health_address, SERVICE) == serving
    with grpc.insecure_channel(health_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            derender_pb2_grpc.DerenderServiceStub(channel).Detokenize(derender_pb2.DetokenizeRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    server.call(lambda: server.running.stop(0))
    with pytest.raises(grpc.RpcError):
        _status(health_address)  # stopped with the server


def test_the_health_address_must_differ_from_the_address():
    with pytest.raises(ConfigError, match="port of its own"):
        ServerConfig(address="127.0.0.1:7000", health_address="127.0.0.1:7000").validate()
