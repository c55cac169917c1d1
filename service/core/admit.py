"""Admitting a request (tokenize, render the chat, check it, compile its constraint) off the event loop when it is
long or constrained: every front end admits through here, so neither a long prompt nor a grammar compile stalls
the other streams, whichever protocol it came by."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# Below this much text, admission (microseconds per hundred characters) costs less than the hop to a worker thread.
LONG_REQUEST_CHARS = 16_384


async def admit_off_loop(admit: Callable[[], T], text_chars: int, constrained: bool = False) -> T:
    """Runs admit() in a worker thread when the request carries more than LONG_REQUEST_CHARS of text (a cheap
    upper bound the front end computes from its request) or a constraint (`constrained`: admission compiles it,
    milliseconds to seconds, and the engine loop never does), else inline."""
    if constrained or text_chars > LONG_REQUEST_CHARS:
        return await asyncio.to_thread(admit)
    return admit()
