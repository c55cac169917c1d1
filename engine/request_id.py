"""What a client-chosen request id may be: the one rule every front end checks before echoing an id back.

Ids travel in gRPC metadata, HTTP headers and logs, so they are limited to visible ASCII (0x21-0x7E: no spaces,
control characters or non-ASCII) and to MAX_REQUEST_ID_CHARS, which holds uuids, trace ids and the router ids
SMG sends ("chatcmpl-<uuid>") with room to spare and stays far below gRPC's 8 KiB metadata limit.
"""

from __future__ import annotations

from pagedserve.engine.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 256


def check_request_id(value: str, field: str = "request_id") -> str:
    """Returns `value` if it is a valid request id, else raises InvalidRequestError naming `field`."""
    if not value:
        raise InvalidRequestError(field, "must not be empty")
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(field, f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}")
    bad = next((ch for ch in value if not "\x21" <= ch <= "\x7e"), None)
    if bad is not None:
        raise InvalidRequestError(
            field, f"must be visible ASCII characters (0x21-0x7E), got {bad!r} at {value.index(bad)}")
    return value
