"""64 concurrent streams over one server: no errors, and each stream gets its own prompt's output."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from service_fixtures import model_info, off_main_thread, shared_server, wait_until  # noqa: F401

from pagedserve.client import AsyncClient, FinishReason
from pagedserve.engine import LLM, SamplingParams

SUBJECTS = ["cats", "the moon", "rivers", "bread", "trains", "music", "winter", "bees", "glass", "maps", "salt",
            "clocks", "forests", "paper", "storms", "bridges"]
PROMPTS = [f"Three facts about {s}:" for s in SUBJECTS]  # 16 distinct prompts, each sent 4 times
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def expected() -> dict[str, tuple[str, tuple[int, ...]]]:
    llm = LLM(max_model_len=512, kv_cache_memory=32 << 20, dtype="float32")
    outputs = off_main_thread(llm.generate, PROMPTS,
                              SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return {p: (o.outputs[0].text, o.outputs[0].token_ids) for p, o in zip(PROMPTS, outputs)}


async def run_streams(target: str, prompts: list[str]) -> list[tuple[str, list[int], str, FinishReason]]:
    async with AsyncClient(target, timeout=600) as client:
        async def one(i: int, prompt: str) -> tuple[str, list[int], str, FinishReason]:
            stream = client.generate(prompt, temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                     request_id=f"stream-{i}")
            text, ids = "", []
            async for delta in stream:
                text += delta.text
                ids.extend(delta.token_ids)
            return text, ids, stream.started.request_id, stream.finals[0].finish_reason

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_64_concurrent_streams_complete_with_independent_correct_outputs(shared_server, expected):  # noqa: F811
    prompts = PROMPTS * 4
    results = asyncio.run(run_streams(shared_server.target, prompts))
    assert len(results) == 64
    for i, (prompt, (text, ids, request_id, reason)) in enumerate(zip(prompts, results)):
        assert request_id == f"stream-{i}"
        assert reason is FinishReason.MAX_TOKENS
        assert (text, tuple(ids)) == expected[prompt], f"stream {i} ({prompt!r})"
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: model_info(channel).kv_cache.used_blocks == 0, 60, "all blocks back in the pool")
