"""One batch of OpenAI chat requests posted at once to a server, timed: the shared driver of the feature comparisons
against vLLM (structured outputs, LoRA adapters). Non-streamed requests, so each reply carries its `usage`; the
batch's time runs from the first send to the last reply. Stdlib only: one thread per request (the servers do the
work; a blocked thread costs nothing)."""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchResult:
    seconds: float
    completion_tokens: tuple[int, ...]
    contents: tuple[str, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.completion_tokens) / self.seconds


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{url}: HTTP {error.code}: {error.read()[:500]!r}") from None


def post_batch(base_url: str, bodies: list[dict], timeout: float = 900) -> BatchResult:
    url = base_url + "/v1/chat/completions"
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        start = time.perf_counter()
        payloads = list(pool.map(lambda b: _post(url, b, timeout), bodies))
        seconds = time.perf_counter() - start
    return BatchResult(seconds, tuple(p["usage"]["completion_tokens"] for p in payloads),
                       tuple(p["choices"][0]["message"]["content"] or "" for p in payloads))


def median_run(results: list[BatchResult]) -> dict:
    """The runs of one system on one workload: the median time and its tokens/s (every run generates the same
    number of tokens under greedy decoding; the spread is reported so a run that did not is visible)."""
    seconds = [r.seconds for r in results]
    tokens = [sum(r.completion_tokens) for r in results]
    median_s = statistics.median(seconds)
    return {"seconds": seconds, "completion_tokens": tokens, "median_s": median_s,
            "tokens_per_s": statistics.median(tokens) / median_s}
