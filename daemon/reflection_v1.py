"""Server reflection under its v1 name (`grpc.reflection.v1.ServerReflection`) beside v1alpha.

Some clients ask for v1 first and do not fall back. grpcio-reflection 1.85 ships only v1alpha;
v1's reflection.proto is the v1alpha file with another package (same messages, same field
numbers, so the same bytes on the wire). So v1 is served by the installed v1alpha servicer
under the v1 method path, and the v1 file's descriptor (derived from the installed v1alpha
descriptor, package renamed) is added to the default pool so that reflection can describe
the v1 service too. A grpcio-reflection that ships `grpc_reflection.v1` is used as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """The v1 file, made from v1alpha's by renaming its package (once per process)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = fdp.package, "grpc.reflection.v1"
    fdp.name, fdp.package = _V1_FILE, new
    for message in fdp.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old}."):
                field.type_name = f".{new}." + field.type_name[len(old) + 2:]
    for service in fdp.service:
        for m in service.method:
            m.input_type = m.input_type.replace(f".{old}.", f".{new}.", 1)
            m.output_type = m.output_type.replace(f".{old}.", f".{new}.", 1)
    pool.Add(fdp)


def enable_reflection_v1(service_names: Iterable[str], server: grpc.Server) -> str | None:
    """Registers reflection v1 on `server`; returns its service name for the listed services
    (None if it could not be registered, then only v1alpha is served)."""
    names = (*service_names, SERVICE_NAME)
    try:
        from grpc_reflection.v1 import reflection as v1
    except ImportError:
        v1 = None
    if v1 is not None:
        v1.enable_server_reflection(names, server)
        return SERVICE_NAME
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = v1alpha.ReflectionServicer(names)
    handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    return SERVICE_NAME
