"""asyncio client: `async for delta in AsyncClient(target).generate(prompt, ...)`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from pagedserve.client.adapters import Adapter, AdapterList, load_request, unload_request
from pagedserve.client.channels import TlsOptions, aio_channel, channel_options, resolve_target
from pagedserve.client.embeddings import (EmbedInput, Embedding, Ranked, embed_request, embeddings, ranking,
                                          rerank_request)
from pagedserve.client.errors import ClientError
from pagedserve.client.frames import FrameReader
from pagedserve.client.request import GenerateOptions, Prompt, build_request
from pagedserve.client.sync_client import DEFAULT_MAX_MESSAGE_BYTES
from pagedserve.client.tracing import with_trace
from pagedserve.client.types import Completion, Delta, Final, Started, Tokenization
from pagedserve.v1 import adapters_pb2, adapters_pb2_grpc, generation_service_pb2_grpc, model_info_pb2, tokenize_pb2


class AsyncGenerationStream(AsyncIterator[Delta]):
    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._frames = call.__aiter__()
        self._reader = FrameReader()
        self._cancelled = False

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            try:
                frame = await self._frames.__anext__()
            except grpc.RpcError as exc:
                raise ClientError.from_rpc(exc) from None
            except asyncio.CancelledError:
                # grpc.aio reports a cancelled call as CancelledError; surface it like the sync client does,
                # unless it is this task itself that is being cancelled.
                if self._cancelled and not _task_cancelling():
                    raise ClientError(grpc.StatusCode.CANCELLED, "cancelled by the client") from None
                raise
            delta = self._reader.read(frame)
            if delta is not None:
                return delta

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def request_id(self) -> str | None:
        return dict(await self._call.initial_metadata() or ()).get("x-request-id")

    @property
    def started(self) -> Started | None:
        return self._reader.started

    @property
    def finals(self) -> dict[int, Final]:
        return self._reader.finals

    async def results(self) -> list[Completion]:
        async for _ in self:
            pass
        return self._reader.results()


class AsyncClient:
    def __init__(self, target: str | Sequence[str], *, tls: TlsOptions | None = None, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float | None = 60.0,
                 load_balancing: str = "round_robin"):
        """target: "host:port", "dns:///name:port" (all of the name's addresses), or a list of "ip:port";
        calls are spread round-robin over the resolved addresses unless load_balancing="pick_first"."""
        self.timeout = timeout
        options = channel_options(tls, max_message_bytes, keepalive_s, load_balancing)
        self._channel = aio_channel(resolve_target(target), tls, options)
        self._stub = generation_service_pb2_grpc.GenerationServiceStub(self._channel)
        self._adapters = adapters_pb2_grpc.AdapterServiceStub(self._channel)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (),
                 traceparent: str | None = None, tracestate: str | None = None,
                 **options: object) -> AsyncGenerationStream:
        """traceparent/tracestate: as Client.generate's."""
        request = build_request(prompt, GenerateOptions.from_kwargs(**options))
        call = self._stub.Generate(request, timeout=timeout or self.timeout,
                                   metadata=with_trace(metadata, traceparent, tracestate))
        return AsyncGenerationStream(call)

    async def complete(self, prompt: Prompt, **kwargs: object) -> Completion:
        results = await self.generate(prompt, **kwargs).results()  # type: ignore[arg-type]
        if len(results) != 1:
            raise ValueError(f"complete() is for n=1; got {len(results)} completions, use generate().results()")
        return results[0]

    async def tokenize(self, text: str, *, add_special_tokens: bool | None = None, offsets: bool = False,
                       timeout: float | None = None) -> Tokenization:
        request = tokenize_pb2.TokenizeRequest(text=text, return_offsets=offsets)
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        response = await self._unary(self._stub.Tokenize, request, timeout)
        return Tokenization(tuple(response.token_ids), tuple((o.start, o.end) for o in response.offsets))

    async def embed(self, inputs: EmbedInput | Sequence[EmbedInput], *, normalize: bool | None = None,
              dimensions: int | None = None, truncate_input_tokens: int | None = None,
              add_special_tokens: bool | None = None, adapter: str | None = None, request_id: str | None = None,
              priority: int = 0, timeout: float | None = None) -> list[Embedding]:
        """One vector per input (a text or token ids), from an embedding model's server."""
        request = embed_request(inputs, normalize=normalize, dimensions=dimensions,
                                truncate_input_tokens=truncate_input_tokens, add_special_tokens=add_special_tokens,
                                adapter=adapter, request_id=request_id, priority=priority)
        return embeddings(await self._unary(self._stub.Embed, request, timeout))

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int = 0, max_tokens_per_query: int = 0,
                     max_tokens_per_doc: int = 0, adapter: str | None = None, request_id: str | None = None,
                     priority: int = 0, timeout: float | None = None) -> list[Ranked]:
        """`documents` best first by relevance to `query` (`top_n` of them; 0: all), from an embedding model's
        server."""
        request = rerank_request(query, documents, top_n=top_n, max_tokens_per_query=max_tokens_per_query,
                                 max_tokens_per_doc=max_tokens_per_doc, adapter=adapter, request_id=request_id,
                                 priority=priority)
        return ranking(await self._unary(self._stub.Rerank, request, timeout))

    async def model_info(self, *, timeout: float | None = None) -> model_info_pb2.ModelInfoResponse:
        return await self._unary(self._stub.ModelInfo, model_info_pb2.ModelInfoRequest(), timeout)

    async def list_adapters(self, *, timeout: float | None = None) -> AdapterList:
        """The LoRA adapters the server holds; `generate(..., adapter=name)` picks one."""
        return AdapterList.from_proto(await self._unary(self._adapters.ListAdapters, adapters_pb2.ListAdaptersRequest(),
                                                    timeout))

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> Adapter:
        """Loads the PEFT folder `path` (on the server's disk, inside its --allowed-lora-dirs) as `name`."""
        reply = await self._unary(self._adapters.LoadAdapter, load_request(name, path), timeout)
        return Adapter.from_proto(reply.adapter)

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Refused (FAILED_PRECONDITION) while requests using the adapter are unfinished."""
        await self._unary(self._adapters.UnloadAdapter, unload_request(name), timeout)

    async def _unary(self, method, request, timeout):  # noqa: ANN001, ANN202 - thin wrapper over generated stubs
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise ClientError.from_rpc(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _task_cancelling() -> bool:
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return bool(cancelling()) if cancelling is not None else False
