"""Per-request timings -> the numbers every benchmark prints.

Every system (in-process or over the wire) reports one RequestTiming per request,
in seconds on one monotonic clock (time.perf_counter) whose zero is the run start.
Definitions (the same for every system, so the ratios are fair):
- output tok/s: generated tokens / (last request finished - run start);
- TTFT: first generated token - the request's arrival;
- inter-token latency: every gap between consecutive tokens of one request, pooled
  over all requests (vLLM's definition); a chunk of k tokens arriving at once adds
  one gap followed by k-1 zero gaps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class RequestTiming:
    request_id: str
    arrival_s: float
    token_times_s: tuple[float, ...]  # one per generated token, same clock as arrival_s
    output_token_ids: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def finish_s(self) -> float:
        return self.token_times_s[-1]


@dataclass(frozen=True, slots=True)
class RunResult:
    system: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    peak_kv_blocks: int | None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(system: str, dtype: str, timings: list[RequestTiming], prompt_tokens: int,
              peak_kv_blocks: int | None = None, extra: dict | None = None) -> RunResult:
    if not timings or any(t.num_output_tokens == 0 for t in timings):
        raise ValueError(f"{system}: every request must have produced at least one token")
    start = min(t.arrival_s for t in timings)
    duration = max(t.finish_s for t in timings) - start
    out_tokens = sum(t.num_output_tokens for t in timings)
    ttfts = [t.ttft_s for t in timings]
    gaps = [b - a for t in timings for a, b in zip(t.token_times_s, t.token_times_s[1:])]
    return RunResult(
        system=system, dtype=dtype, num_requests=len(timings), prompt_tokens=prompt_tokens,
        output_tokens=out_tokens, duration_s=duration, output_tok_s=out_tokens / duration,
        total_tok_s=(out_tokens + prompt_tokens) / duration,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        itl_p50_ms=1e3 * percentile(gaps, 50), itl_p99_ms=1e3 * percentile(gaps, 99),
        peak_kv_blocks=peak_kv_blocks, extra=dict(extra or {}))


_MEDIAN_FIELDS = ("duration_s", "output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s",
                  "itl_p50_ms", "itl_p99_ms")


def median_result(runs: list[RunResult]) -> dict:
    """Median of each metric over repetitions, plus min/max of output tok/s."""
    first = runs[0]
    out = {"system": first.system, "dtype": first.dtype, "repeats": len(runs),
           "num_requests": first.num_requests, "prompt_tokens": first.prompt_tokens,
           "output_tokens": first.output_tokens, "peak_kv_blocks": first.peak_kv_blocks}
    for name in _MEDIAN_FIELDS:
        out[name] = statistics.median(getattr(r, name) for r in runs)
    tok_s = [r.output_tok_s for r in runs]
    out["output_tok_s_min"], out["output_tok_s_max"] = min(tok_s), max(tok_s)
    extras = [r.extra for r in runs if r.extra]
    if extras:
        out["extra"] = extras[-1]
    return out


def ratios(medians: dict[str, dict], ours: str, others: list[str]) -> dict[str, dict]:
    """ours/other for throughput (higher is better) and other/ours for TTFT p50
    (so > 1 means we are faster on both)."""
    result = {}
    for other in others:
        if other not in medians or ours not in medians:
            continue
        a, b = medians[ours], medians[other]
        result[f"{ours}_vs_{other}"] = {
            "output_tok_s_ratio": a["output_tok_s"] / b["output_tok_s"],
            "ttft_p50_speedup": b["ttft_p50_s"] / a["ttft_p50_s"],
        }
    return result


def token_agreement(a: list[RequestTiming], b: list[RequestTiming]) -> dict:
    """How many requests produced identical token ids in two systems (fidelity check)."""
    by_id = {t.request_id: t.output_token_ids for t in b}
    both = [t for t in a if t.output_token_ids and by_id.get(t.request_id)]
    same = sum(1 for t in both if t.output_token_ids == by_id[t.request_id])
    return {"compared": len(both), "identical": same}
