"""Blocking client: `Client(target).generate(prompt, ...)` yields Deltas as they arrive."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from pagedserve.client.adapters import Adapter, AdapterList, load_request, unload_request
from pagedserve.client.channels import TlsOptions, channel_options, resolve_target, sync_channel
from pagedserve.client.embeddings import (EmbedInput, Embedding, Ranked, embed_request, embeddings, ranking,
                                          rerank_request)
from pagedserve.client.errors import ClientError
from pagedserve.client.frames import FrameReader
from pagedserve.client.request import GenerateOptions, Prompt, build_request
from pagedserve.client.tracing import with_trace
from pagedserve.client.types import Completion, Delta, Final, Started, Tokenization
from pagedserve.v1 import (
    adapters_pb2, adapters_pb2_grpc, generate_pb2, generation_service_pb2_grpc, model_info_pb2, tokenize_pb2,
)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class GenerationStream(Iterator[Delta]):
    """Iterate for Deltas; `started`, `finals` and `results()` hold the rest. `cancel()` aborts the request."""

    def __init__(self, call: grpc.CallIterator) -> None:
        self._call = call
        self._reader = FrameReader()

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> Delta:
        while True:
            try:
                frame = next(self._call)
            except grpc.RpcError as exc:
                raise ClientError.from_rpc(exc) from None
            delta = self._reader.read(frame)
            if delta is not None:
                return delta

    def cancel(self) -> None:
        self._call.cancel()

    @property
    def request_id(self) -> str | None:
        """From the response metadata (available before the first frame)."""
        return dict(self._call.initial_metadata() or ()).get("x-request-id")

    @property
    def started(self) -> Started | None:
        return self._reader.started

    @property
    def finals(self) -> dict[int, Final]:
        return self._reader.finals

    @property
    def heartbeats(self) -> int:
        return self._reader.heartbeats

    def results(self) -> list[Completion]:
        """Reads the stream to its end; one Completion per index."""
        for _ in self:
            pass
        return self._reader.results()


class Client:
    def __init__(self, target: str | Sequence[str], *, tls: TlsOptions | None = None, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float | None = 60.0,
                 load_balancing: str = "round_robin"):
        """target: "host:port", "dns:///name:port" (all of the name's addresses), or a list of "ip:port";
        calls are spread round-robin over the resolved addresses unless load_balancing="pick_first"."""
        self.timeout = timeout
        options = channel_options(tls, max_message_bytes, keepalive_s, load_balancing)
        self._channel = sync_channel(resolve_target(target), tls, options)
        self._stub = generation_service_pb2_grpc.GenerationServiceStub(self._channel)
        self._adapters = adapters_pb2_grpc.AdapterServiceStub(self._channel)

    def generate(self, prompt: Prompt, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (),
                 traceparent: str | None = None, tracestate: str | None = None,
                 **options: object) -> GenerationStream:
        """traceparent/tracestate: the W3C trace context the server's span joins (default: the current
        OpenTelemetry context, when opentelemetry-api is installed)."""
        request = build_request(prompt, GenerateOptions.from_kwargs(**options))
        return GenerationStream(self.generate_raw(request, timeout=timeout,
                                                  metadata=with_trace(metadata, traceparent, tracestate)))

    def generate_raw(self, request: generate_pb2.GenerateRequest, *, timeout: float | None = None,
                     metadata: Sequence[tuple[str, str]] = ()) -> grpc.CallIterator:
        """The underlying call for a hand-built request (frames as protos)."""
        return self._stub.Generate(request, timeout=timeout or self.timeout, metadata=tuple(metadata))

    def complete(self, prompt: Prompt, **kwargs: object) -> Completion:
        """One completion (n must be 1), read to the end."""
        results = self.generate(prompt, **kwargs).results()  # type: ignore[arg-type]
        if len(results) != 1:
            raise ValueError(f"complete() is for n=1; got {len(results)} completions, use generate().results()")
        return results[0]

    def tokenize(self, text: str, *, add_special_tokens: bool | None = None, offsets: bool = False,
                 timeout: float | None = None) -> Tokenization:
        request = tokenize_pb2.TokenizeRequest(text=text, return_offsets=offsets)
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        response = self._unary(self._stub.Tokenize, request, timeout)
        return Tokenization(tuple(response.token_ids), tuple((o.start, o.end) for o in response.offsets))

    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], *, normalize: bool | None = None,
              dimensions: int | None = None, truncate_input_tokens: int | None = None,
              add_special_tokens: bool | None = None, adapter: str | None = None, request_id: str | None = None,
              priority: int = 0, timeout: float | None = None) -> list[Embedding]:
        """One vector per input (a text or token ids), from an embedding model's server."""
        request = embed_request(inputs, normalize=normalize, dimensions=dimensions,
                                truncate_input_tokens=truncate_input_tokens, add_special_tokens=add_special_tokens,
                                adapter=adapter, request_id=request_id, priority=priority)
        return embeddings(self._unary(self._stub.Embed, request, timeout))

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int = 0, max_tokens_per_query: int = 0,
               max_tokens_per_doc: int = 0, adapter: str | None = None, request_id: str | None = None,
               priority: int = 0, timeout: float | None = None) -> list[Ranked]:
        """`documents` best first by relevance to `query` (`top_n` of them; 0: all), from an embedding model's
        server."""
        request = rerank_request(query, documents, top_n=top_n, max_tokens_per_query=max_tokens_per_query,
                                 max_tokens_per_doc=max_tokens_per_doc, adapter=adapter, request_id=request_id,
                                 priority=priority)
        return ranking(self._unary(self._stub.Rerank, request, timeout))

    def model_info(self, *, timeout: float | None = None) -> model_info_pb2.ModelInfoResponse:
        return self._unary(self._stub.ModelInfo, model_info_pb2.ModelInfoRequest(), timeout)

    def list_adapters(self, *, timeout: float | None = None) -> AdapterList:
        """The LoRA adapters the server holds; `generate(..., adapter=name)` picks one."""
        return AdapterList.from_proto(self._unary(self._adapters.ListAdapters, adapters_pb2.ListAdaptersRequest(),
                                                    timeout))

    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> Adapter:
        """Loads the PEFT folder `path` (on the server's disk, inside its --allowed-lora-dirs) as `name`."""
        reply = self._unary(self._adapters.LoadAdapter, load_request(name, path), timeout)
        return Adapter.from_proto(reply.adapter)

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Refused (FAILED_PRECONDITION) while requests using the adapter are unfinished."""
        self._unary(self._adapters.UnloadAdapter, unload_request(name), timeout)

    def _unary(self, method, request, timeout):  # noqa: ANN001, ANN202 - thin wrapper over generated stubs
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise ClientError.from_rpc(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
