"""Typed engine errors, and their fields renamed to the paths a front end's clients set (`renamed`). The service
maps each class to one gRPC status code."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
    """One request failed inside the engine (its logits went non-finite, or its own sampling, grammar mask,
    verification, stop rules or submission raised); the engine and its batch mates go on."""


class StepFailedError(PagedServeError):
    """The engine step computing this request failed as a whole (an exception out of the forward), so every request
    in it failed; the engine goes on serving, and a retry may succeed (gRPC UNAVAILABLE, HTTP 503)."""


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


@contextmanager
def renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """Re-raises a request error under the name the front end's client knows (the class, and so the status, stays)."""
    try:
        yield
    except InvalidRequestError as exc:
        field = rename(exc.field)
        if field == exc.field:
            raise
        raise type(exc)(field, exc.message) from None


def field_map(names: dict[str, str]) -> Callable[[str], str]:
    """A renamer from {admission or SamplingParams field: front-end path}; `name[3].x` follows `name`."""

    def rename(field: str) -> str:
        head, rest = _split(field)
        return names[head] + rest if head in names else field

    return rename


def _split(field: str) -> tuple[str, str]:
    cut = min((i for i in (field.find("["), field.find(".")) if i >= 0), default=len(field))
    return field[:cut], field[cut:]
