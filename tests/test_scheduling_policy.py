"""`--scheduling-policy`: first come first served, or by priority (lower first, then arrival), as vLLM: the queue
admits by rank, and under KV-cache pressure the running sequence that ranks last gives way. Real engines over a tiny
random Llama; through a real server, priorities reach the engine from OpenAI HTTP and pagedserve.v1. Also the
engine's `--seed`, which orders the generators unseeded requests draw from."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests
from conftest import make_tiny_model
from pagedserve.client import Client
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.requests import GenerationRequest, TokensPrompt
from service_fixtures import start_server

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-policy"))


def engine(path, policy: str, **fields) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, scheduling_policy=policy,
                                  enable_prefix_caching=False, **fields))


def submit(llm: LLMEngine, name: str, priority: int, prompt_len: int = 8, max_tokens: int = 4) -> None:
    prompt = TokensPrompt(tuple(range(10, 10 + prompt_len)))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    llm.submit(name, llm.admission.admit(GenerationRequest(prompt, params, priority=priority)))


def run_all(llm: LLMEngine) -> tuple[list[str], dict]:
    """(request ids in the order they finished, their final outputs)."""
    order, finals = [], {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                order.append(out.request_id)
                finals[out.request_id] = out
    return order, finals


def test_the_queue_admits_by_priority_then_arrival(tiny_path):
    llm = engine(tiny_path, "priority", max_num_seqs=1)
    for name, priority in (("late-5a", 5), ("zero", 0), ("late-5b", 5), ("minus", -1), ("zero-b", 0)):
        submit(llm, name, priority)
    assert run_all(llm)[0] == ["minus", "zero", "zero-b", "late-5a", "late-5b"]


def test_fcfs_keeps_arrival_order(tiny_path):
    llm = engine(tiny_path, "fcfs", max_num_seqs=1)
    for name in ("a", "b", "c"):
        submit(llm, name, 0)
    assert run_all(llm)[0] == ["a", "b", "c"]


def _pressure(policy: str, tiny_path) -> dict:
    """Three sequences admitted together whose growth needs more blocks than the cache holds; the first to arrive
    has the lowest priority (the largest number)."""
    per_block = 2 * 2 * 2 * 16 * 4 * BLOCK  # layers x (K, V) x KV heads x head dim x fp32 bytes x tokens
    llm = engine(tiny_path, policy, kv_cache_memory=9 * per_block, max_num_batched_tokens=64)
    assert llm.block_manager.num_blocks == 9
    for name, priority in (("low", 1), ("high", 0), ("newest", 0)):
        submit(llm, name, priority if policy == "priority" else 0, prompt_len=BLOCK, max_tokens=3 * BLOCK)
    return run_all(llm)[1]


def test_under_kv_pressure_the_lowest_priority_gives_way_not_the_newest(tiny_path):
    by_priority = _pressure("priority", tiny_path)
    assert by_priority["low"].metrics.num_preemptions >= 1
    assert by_priority["high"].metrics.num_preemptions == by_priority["newest"].metrics.num_preemptions == 0
    fcfs = _pressure("fcfs", tiny_path)
    assert fcfs["newest"].metrics.num_preemptions >= 1 and fcfs["low"].metrics.num_preemptions == 0
    for name in by_priority:  # recomputed after preemption: the same tokens either way
        assert by_priority[name].outputs[0].token_ids == fcfs[name].outputs[0].token_ids


def test_priorities_are_refused_by_name_where_they_mean_nothing(tiny_path):
    fcfs = engine(tiny_path, "fcfs")
    request = GenerationRequest(TokensPrompt((5, 6)), SamplingParams(max_tokens=2), priority=3)
    with pytest.raises(InvalidRequestError, match="priority: got 3, but this server schedules first come"):
        fcfs.admission.admit(request)
    for bad in (True, 1.5, 2**63):
        with pytest.raises(InvalidRequestError, match="priority: must be a 64-bit integer"):
            engine(tiny_path, "priority").admission.admit(
                GenerationRequest(TokensPrompt((5, 6)), SamplingParams(max_tokens=2), priority=bad))
    with pytest.raises(ConfigError, match="scheduling_policy: unknown 'lifo'; supported: fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")


def test_a_server_with_the_priority_policy_serves_the_urgent_request_first(tmp_path, tiny_path):
    """One sequence at a time: a long request holds the slot while a low- and then a high-priority request queue
    behind it, one over OpenAI HTTP and one over pagedserve.v1; the high one finishes first."""
    server = start_server(tmp_path, "--model", str(tiny_path), "--dtype", "float32", "--http-port", "0",
                          "--scheduling-policy", "priority", "--max-num-seqs", "1")
    url = f"{server.http_url}/v1/completions"
    body = {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True}
    done: dict[str, float] = {}

    def http(name: str, priority: int, tokens: int) -> None:
        reply = requests.post(url, json={**body, "max_tokens": tokens, "priority": priority}, timeout=300)
        assert reply.status_code == 200, reply.text
        done[name] = time.monotonic()

    def v1(name: str, priority: int) -> None:
        with Client(server.target, timeout=300) as client:
            client.complete([5, 6, 7], temperature=0, max_new_tokens=8, ignore_eos=True, priority=priority)
        done[name] = time.monotonic()

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(http, "holder", 0, 400)
            _wait_running(server.metrics_port)
            low = pool.submit(http, "low", 7, 8)
            _wait_waiting(server.metrics_port, 1)
            high = pool.submit(v1, "high", -2)
            for job in (first, low, high):
                job.result(timeout=300)
        assert done["high"] < done["low"]
        reply = requests.post(url, json={**body, "max_tokens": 2, "priority": "soon"}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority"
    finally:
        server.stop()


def _gauge(metrics_port: int, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _wait_running(port: int) -> None:
    for _ in range(600):
        if _gauge(port, "vllm:num_requests_running") >= 1:
            return
        time.sleep(0.02)
    raise AssertionError("the first request never started")


def _wait_waiting(port: int, count: int) -> None:
    for _ in range(600):
        if _gauge(port, "vllm:num_requests_waiting") >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"never {count} waiting")


def test_the_engine_seed_makes_unseeded_sampling_repeat_after_a_restart(tiny_path):
    """vLLM's --seed: the same requests in the same order sample the same tokens on a fresh engine; another seed
    samples others (a request's own seed still wins)."""
    def sampled(seed: int, own_seed: int | None = None) -> list[tuple[int, ...]]:
        llm = engine(tiny_path, "fcfs", seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=own_seed)
        for name in ("a", "b"):
            llm.submit(name, llm.admission.admit(GenerationRequest(TokensPrompt((5, 6, 7)), params)))
        finals = run_all(llm)[1]
        return [finals[name].outputs[0].token_ids for name in ("a", "b")]

    first = sampled(7)
    assert sampled(7) == first and sampled(8) != first
    assert sampled(7, own_seed=3) == sampled(8, own_seed=3)
    with pytest.raises(ConfigError, match="seed: must be an integer"):
        EngineConfig(seed=-1)
