"""grpc's standard services (health v1, reflection v1 and v1alpha) served from raw bytes, like our own services:
a request that does not parse gets INVALID_ARGUMENT naming it.

grpc's generated registrations deserialize before the servicer runs, and a request they cannot parse ends the
call with UNKNOWN (found by tests/test_fuzz_grpc.py). The logic stays grpc's own servicers'.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES = (reflection.SERVICE_NAME, REFLECTION_V1)  # same messages, renamed package


def health_rpc_handler(health: HealthServicer, max_message_bytes: int) -> grpc.GenericRpcHandler:
    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckRequest:
        if len(raw) > max_message_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: over {max_message_bytes} bytes")
        try:
            return health_pb2.HealthCheckRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: cannot parse HealthCheckRequest: {exc}")

    async def check(raw: bytes, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        return await health.Check(await parse(raw, context), context)

    async def watch(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        await health.Watch(await parse(raw, context), context)

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(check, response_serializer=serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, response_serializer=serialize),
    })


def reflection_rpc_handlers(service_names: tuple[str, ...]) -> tuple[grpc.GenericRpcHandler, ...]:
    servicer = ReflectionServicer(service_names)

    async def info(raw_requests, context: grpc.aio.ServicerContext):
        async def parsed():
            async for raw in raw_requests:
                try:
                    yield reflection_pb2.ServerReflectionRequest.FromString(raw)
                except DecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"request: cannot parse ServerReflectionRequest: {exc}")

        async for response in servicer.ServerReflectionInfo(parsed(), context):
            yield response

    handler = grpc.stream_stream_rpc_method_handler(
        info, response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return tuple(grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
                 for name in REFLECTION_SERVICES)
