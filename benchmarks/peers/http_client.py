"""Drives the workload through an OpenAI-compatible /v1/completions server (vLLM,
llama-server) with streaming, stdlib only (asyncio streams + SSE parsing), so the
client costs the same for every server and needs no extra packages.

Token counting: each SSE chunk carries one or more generated tokens. We read the
count from `usage.completion_tokens` when the server streams it (vLLM with
continuous_usage_stats), else from the token ids in the chunk (vLLM return_token_ids,
llama-server's native `tokens`), else 1 per non-final chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from metrics import RequestTiming
from workload import BenchRequest, Workload


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # e.g. http://127.0.0.1:8001/v1/completions
    model: str
    extra_body: tuple[tuple[str, object], ...] = ()
    # "openai": /v1/completions; "llama": llama-server's native /completion, the only one
    # of its endpoints that streams the generated token ids (used for the fidelity check)
    style: str = "openai"

    def body(self, req: BenchRequest) -> dict:
        ids = list(req.prompt_token_ids)
        if self.style == "llama":
            body = {"prompt": ids, "n_predict": req.max_tokens, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "return_tokens": True}
        else:
            body = {"model": self.model, "prompt": ids, "max_tokens": req.max_tokens, "temperature": 0.0,
                    "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        body.update(dict(self.extra_body))
        return body


async def _post_stream(endpoint: Endpoint, body: dict):
    """Yields the JSON payload of every `data:` line of one streamed POST."""
    u = urlparse(endpoint.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80, limit=1 << 22)
    payload = json.dumps(body).encode()
    head = (f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + payload)
    await writer.drain()
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            rest = await reader.read()
            raise RuntimeError(f"{endpoint.url}: {status.decode().strip()} {rest[-500:]!r}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
        async for line in _lines(reader, chunked):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
    finally:
        writer.close()


async def _lines(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while line := await reader.readline():
            yield line
        return
    buf = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        buf += await reader.readexactly(size)
        await reader.readline()  # the CRLF after each chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line
    if buf:
        yield buf


async def _one(endpoint: Endpoint, req: BenchRequest, t0: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    arrival = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    async for chunk in _post_stream(endpoint, endpoint.body(req)):
        now = time.perf_counter()
        new_ids, count, is_token = _parse(chunk)
        ids.extend(new_ids)
        if count is not None:
            _pad_to(times, count, now)
        elif new_ids:
            times.extend([now] * len(new_ids))
        elif is_token:
            times.append(now)
    if len(times) > req.max_tokens:  # a final empty chunk counted as a token
        times = times[: req.max_tokens]
    return RequestTiming(req.request_id, arrival, tuple(times), tuple(ids))


def _parse(chunk: dict) -> tuple[list[int], int | None, bool]:
    """(new token ids, running completion-token count if streamed, whether it is a token chunk)."""
    if "choices" not in chunk:  # llama-server native: {"content", "tokens", "stop"}
        # A token that ends mid UTF-8 character is held back and sent with the next one, and that chunk's "tokens"
        # lists only the newer id (a byte-level vocabulary makes that common on random prompts): the final chunk's
        # tokens_predicted is the count of tokens generated.
        count = chunk.get("tokens_predicted") if chunk.get("stop", False) else None
        return list(chunk.get("tokens") or []), count, not chunk.get("stop", False)
    usage = chunk.get("usage") or {}
    count = usage.get("completion_tokens")
    choices = chunk["choices"]
    if not choices:  # OpenAI's trailing usage-only chunk
        return [], count, False
    choice = choices[0]
    return list(choice.get("token_ids") or []), count, choice.get("finish_reason") is None


def _pad_to(times: list[float], count: int | None, now: float) -> None:
    if count is not None and count > len(times):
        times.extend([now] * (count - len(times)))


async def _run(endpoint: Endpoint, workload: Workload) -> list[RequestTiming]:
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(_one(endpoint, r, t0) for r in workload.requests)))


def run_http(endpoint: Endpoint, workload: Workload) -> list[RequestTiming]:
    return asyncio.run(_run(endpoint, workload))
