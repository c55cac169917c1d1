"""Drives the workload through pagedserve's gRPC server with the project's asyncio client,
one streaming Generate per request, all on one channel (as a gateway would)."""

from __future__ import annotations

import asyncio
import time

from metrics import RequestTiming
from workload import BenchRequest, Workload


async def _one(client, req: BenchRequest, t0: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    arrival = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    stream = client.generate(list(req.prompt_token_ids), max_new_tokens=req.max_tokens, temperature=0.0,
                             ignore_eos=True, request_id=req.request_id)
    async for delta in stream:
        now = time.perf_counter()
        times.extend([now] * len(delta.token_ids))
        ids.extend(delta.token_ids)
    return RequestTiming(req.request_id, arrival, tuple(times), tuple(ids))


async def _run(target: str, workload: Workload) -> list[RequestTiming]:
    from pagedserve.client import AsyncClient

    async with AsyncClient(target, timeout=3600) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, r, t0) for r in workload.requests)))


def run_grpc(target: str, workload: Workload) -> list[RequestTiming]:
    return asyncio.run(_run(target, workload))
