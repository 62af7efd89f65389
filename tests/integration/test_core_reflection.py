"""Server reflection answers as grpc.reflection.v1 and v1alpha alike, each spoken by a raw client
with that version's own message types (v1's built from the descriptor reflection serves)."""

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from tito import reflection
from tito.config import ServerConfig
from tito.serving import start_server
from tito.v1 import derender_pb2_grpc

SERVICE = "tito.v1.DerenderService"


def _v1_messages():
    """grpc.reflection.v1's request and response classes, from a pool of their own."""
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(reflection.v1_file_descriptor_proto().SerializeToString())
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
                 for name in ("ServerReflectionRequest", "ServerReflectionResponse"))


VERSIONS = {
    "v1": ("grpc.reflection.v1", *_v1_messages()),
    "v1alpha": ("grpc.reflection.v1alpha", v1alpha_pb2.ServerReflectionRequest,
                v1alpha_pb2.ServerReflectionResponse),
}


@pytest.fixture(scope="module")
def server(module_aio_server):
    async def make():
        running = await start_server(ServerConfig(address="127.0.0.1:0"), [SERVICE],
                                     lambda s: derender_pb2_grpc.add_DerenderServiceServicer_to_server(
                                         derender_pb2_grpc.DerenderServiceServicer(), s))
        await running.set_serving()
        return running
    return module_aio_server(make)


def _ask(server, version: str, **request_fields):
    package, request_type, response_type = VERSIONS[version]
    with server.channel() as channel:
        call = channel.stream_stream(f"/{package}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=request_type.SerializeToString,
                                     response_deserializer=response_type.FromString)
        replies = list(call(iter([request_type(**request_fields)]), timeout=10))
    assert len(replies) == 1 and isinstance(replies[0], response_type)
    return replies[0]


def _file_names(reply) -> set[str]:
    return {descriptor_pb2.FileDescriptorProto.FromString(raw).name
            for raw in reply.file_descriptor_response.file_descriptor_proto}


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_lists_the_service_health_and_both_reflections(server, version):
    reply = _ask(server, version, list_services="")
    names = {service.name for service in reply.list_services_response.service}
    assert names == {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                     "grpc.reflection.v1alpha.ServerReflection"}


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_describes_tito_and_both_reflection_services(server, version):
    reply = _ask(server, version, file_containing_symbol=SERVICE)
    assert {"tito/v1/derender.proto", "tito/v1/engine.proto", "tito/v1/chat.proto"} <= _file_names(reply)
    for package, *_ in VERSIONS.values():
        reply = _ask(server, version, file_containing_symbol=f"{package}.ServerReflection")
        (raw,) = reply.file_descriptor_response.file_descriptor_proto
        described = descriptor_pb2.FileDescriptorProto.FromString(raw)
        assert described.package == package
        method = described.service[0].method[0]
        assert method.input_type == f".{package}.ServerReflectionRequest" and method.client_streaming


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_answers_an_unknown_symbol_not_found_and_echoes_the_request(server, version):
    reply = _ask(server, version, file_containing_symbol="tito.v1.NoSuchThing")
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert reply.original_request.file_containing_symbol == "tito.v1.NoSuchThing"


def test_the_derived_v1_file_names_only_v1_types():
    proto = reflection.v1_file_descriptor_proto()
    text = str(proto)
    assert "v1alpha" not in text and proto.options.java_package == "io.grpc.reflection.v1"


@pytest.mark.parametrize("exempt", [True, False])
def test_v1_reflection_is_open_under_a_token_exactly_when_v1alpha_is(aio_server, tmp_path, exempt):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 40)

    async def make():
        config = ServerConfig(address="127.0.0.1:0", auth_token_file=str(token_file), auth_exempt_health=exempt)
        return await start_server(config, [SERVICE], lambda s: derender_pb2_grpc.add_DerenderServiceServicer_to_server(
            derender_pb2_grpc.DerenderServiceServicer(), s))

    server = aio_server(make)
    for version in VERSIONS:
        if exempt:
            assert _ask(server, version, list_services="").list_services_response.service
        else:
            with pytest.raises(grpc.RpcError) as info:
                _ask(server, version, list_services="")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
