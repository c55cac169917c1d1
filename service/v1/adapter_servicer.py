"""pagedserve.v1 AdapterService: ListAdapters (always), LoadAdapter / UnloadAdapter (only with runtime adapter
updates on). The checks and errors are the OpenAI routes' own (service/core/adapters.py)."""

from __future__ import annotations

import grpc

from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.service.core import rpc_status
from pagedserve.service.core.adapters import AdapterAdmin
from pagedserve.service.core.context import ServingContext
from pagedserve.service.core.wire import parse_request
from pagedserve.v1 import adapters_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterService"].full_name


def adapter_message(info: AdapterInfo) -> pb.Adapter:
    return pb.Adapter(name=info.name, adapter_id=info.adapter_id, path=info.path, rank=info.rank,
                      target_modules=list(info.target_modules))


class AdapterServicer:
    def __init__(self, serving: ServingContext, max_message_bytes: int):
        self.serving, self.admin = serving, AdapterAdmin(serving)
        self.max_message_bytes = max_message_bytes

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        m, name = self.serving.metrics, SERVICE_NAME

        def unary(method: str, impl, response: type) -> grpc.RpcMethodHandler:  # noqa: ANN001
            return grpc.unary_unary_rpc_method_handler(rpc_status.unary(m, name, method, impl),
                                                       response_serializer=response.SerializeToString)

        return grpc.method_handlers_generic_handler(name, {
            "ListAdapters": unary("ListAdapters", self.list_adapters, pb.ListAdaptersResponse),
            "LoadAdapter": unary("LoadAdapter", self.load_adapter, pb.LoadAdapterResponse),
            "UnloadAdapter": unary("UnloadAdapter", self.unload_adapter, pb.UnloadAdapterResponse),
        })

    async def list_adapters(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        parse_request(raw, pb.ListAdaptersRequest, self.max_message_bytes)
        self.serving.state.check_ready()
        lora = self.admin.lora
        reply = pb.ListAdaptersResponse(adapters=[adapter_message(a) for a in self.admin.adapters()],
                                        lora_enabled=lora is not None, base_model=self.serving.model_name)
        if lora is not None:
            reply.runtime_updates, reply.max_loras, reply.max_lora_rank = (
                lora.runtime_updates, lora.max_loras, lora.max_lora_rank)
        return reply

    async def load_adapter(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.LoadAdapterResponse:
        request = parse_request(raw, pb.LoadAdapterRequest, self.max_message_bytes)
        info = await self.admin.load(request.lora_name, request.lora_path)
        return pb.LoadAdapterResponse(adapter=adapter_message(info))

    async def unload_adapter(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.UnloadAdapterResponse:
        request = parse_request(raw, pb.UnloadAdapterRequest, self.max_message_bytes)
        await self.admin.unload(request.lora_name)
        return pb.UnloadAdapterResponse()
