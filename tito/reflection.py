"""gRPC server reflection under both names clients ask for: grpc.reflection.v1 and v1alpha.

grpcio-reflection serves only `grpc.reflection.v1alpha.ServerReflection`, but current clients
(grpcurl 1.9+, Postman, grpc-js tooling, buf curl) try `grpc.reflection.v1` first, and some
never fall back. The two versions differ only in their package name: every message, field
number and type is the same, so their bytes on the wire are identical. The v1 service is
therefore the v1alpha servicer mounted a second time under the v1 name (its messages parse and
serialize the v1 bytes unchanged), and the v1 descriptor, derived from the v1alpha one by
renaming the package, is added to the descriptor pool so that reflection can describe itself
under both names.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = reflection_v1alpha.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_METHOD = "ServerReflectionInfo"


def v1_file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: the v1alpha file with the v1 package and options."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix, new_prefix = f".{v1alpha_pb2.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE_NAME, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old_prefix):
                field.type_name = new_prefix + field.type_name.removeprefix(old_prefix)
    for method in proto.service[0].method:
        method.input_type = new_prefix + method.input_type.removeprefix(old_prefix)
        method.output_type = new_prefix + method.output_type.removeprefix(old_prefix)
    # The options upstream's v1 file declares (v1alpha's name its own package instead).
    proto.options.Clear()
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    return proto


def ensure_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add the v1 reflection file to `pool` (the default pool) unless it is there already."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE_NAME)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor_proto().SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection on `server` as v1 and v1alpha, listing `service_names` and both
    reflection services."""
    ensure_v1_descriptor()
    names = (*service_names, *SERVICE_NAMES)
    servicer = reflection_v1alpha.aio.ReflectionServicer(names)
    reflection_v1alpha.enable_server_reflection(names, server)
    handlers = {_METHOD: grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        # v1 and v1alpha messages have the same bytes: v1alpha's classes read and write v1's.
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),))
