"""pagedserve.client: a typed Python client for the pagedserve gRPC API (sync and asyncio)."""

from pagedserve.client.adapters import Adapter, AdapterList
from pagedserve.client.async_client import AsyncClient, AsyncGenerationStream
from pagedserve.client.channels import TlsOptions
from pagedserve.client.constraints import Choice, Constraint, Grammar, JsonObject, JsonSchema, Regex, StructuralTag
from pagedserve.client.embeddings import Embedding, Ranked
from pagedserve.client.errors import ClientError
from pagedserve.client.request import GenerateOptions, Message, build_request
from pagedserve.client.sync_client import Client, GenerationStream
from pagedserve.client.types import (
    Completion,
    Delta,
    Final,
    FinishReason,
    Started,
    Timing,
    Tokenization,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Adapter", "AdapterList",
    "AsyncClient", "AsyncGenerationStream", "Choice", "Client", "ClientError", "Completion", "Constraint", "Delta",
    "Embedding", "Final", "FinishReason", "GenerateOptions", "GenerationStream", "Grammar", "JsonObject", "JsonSchema",
    "Message", "Ranked", "Regex", "Started", "StructuralTag", "Timing", "TokenLogprob", "Tokenization", "TlsOptions",
    "Usage", "build_request",
]
