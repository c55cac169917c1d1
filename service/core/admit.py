"""Admitting a request (tokenize, render the chat, check it) off the event loop when it is long: every front end
admits through here, so a long prompt never stalls the other streams, whichever protocol it came by."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# Below this much text, admission (microseconds per hundred characters) costs less than the hop to a worker thread.
LONG_REQUEST_CHARS = 16_384


async def admit_off_loop(admit: Callable[[], T], text_chars: int) -> T:
    """Runs admit() in a worker thread when the request carries more than LONG_REQUEST_CHARS of text (a cheap
    upper bound the front end computes from its request), else inline."""
    if text_chars > LONG_REQUEST_CHARS:
        return await asyncio.to_thread(admit)
    return admit()
