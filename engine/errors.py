"""Typed engine errors. The service maps each class to one gRPC status code."""

from __future__ import annotations


class PagedServeError(Exception):
    """Base of every error pagedserve raises on purpose."""


class InvalidRequestError(PagedServeError, ValueError):
    """A client-supplied value is wrong. `field` names it so callers can point at it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(PagedServeError, ValueError):
    """An engine/server configuration value is wrong (operator mistake, not client mistake)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(PagedServeError):
    """A model folder or checkpoint cannot be loaded; the message names the file, tensor or field."""


class UnsupportedError(PagedServeError):
    """A registry lookup failed; the message lists what is supported."""


class UnsupportedTaskError(PagedServeError):
    """The request asks for what the server's model does not run: an embedding from a server that generates, or a
    generation from one that embeds (`--runner`), as vLLM refuses the other task's API (gRPC UNIMPLEMENTED)."""


class CapacityError(InvalidRequestError):
    """The request can never fit (for example larger than the whole KV cache); `field` names what to shrink."""


class MissingChatTemplateError(PagedServeError):
    """Chat messages were sent to a model that has no chat template (and no override was given)."""


class QueueFullError(PagedServeError):
    """The admission queue is full; the client should retry later."""


class RequestFailedError(PagedServeError):
    """One request failed inside the engine (its logits went non-finite); the engine and its batch mates go on."""


class EngineDeadError(PagedServeError):
    """The engine loop stopped; no further requests can be served."""


class AdapterNotFoundError(InvalidRequestError):
    """A request or an unload names a LoRA adapter the server does not have (gRPC NOT_FOUND, HTTP 404)."""


class AdapterLoadError(InvalidRequestError):
    """A LoRA adapter cannot be loaded: missing or pickled files, unsupported options, rank above the limit, shapes
    that do not fit the base, a path outside the allowed folders. `field` names the offending file key or option."""


class AdapterInUseError(PagedServeError):
    """An unload (or a reload under the same name) while requests using the adapter are in flight (gRPC
    FAILED_PRECONDITION, HTTP 409): refused, never breaking them."""
