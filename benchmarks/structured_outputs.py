"""What do structured outputs cost? (Never in CI.)

    python benchmarks/structured_outputs.py                    # default model, 32 requests, repeats 3
    python benchmarks/structured_outputs.py --requests 32 --repeats 5 --threads 2

Three figures, printed as one JSON object with the machine (CPU model, usable cores, load average before/after):
- throughput: 32 concurrent requests, half constrained by a 10-field JSON Schema (tests/fixtures/
  service_schemas.json: ten_fields), against the same workload unconstrained: the same prompts, and each twin
  request runs exactly as many tokens (max_tokens = the constrained output's length, ignore_eos), so both runs do
  the same work and differ only by the constraints. Runs alternate (A/B), medians reported; target ratio >= 0.9.
- compile: p50/p99 compile time over the test schemas, cold (a new compiler each, the grammar library's tokenizer
  view built once beforehand and reported apart) and cached (the same schema again).
- mask: per step with constrained rows, the time to fill the bitmasks (the grammar library) and to apply them to
  the logits (this engine), median and p90, with the number of constrained rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.constraint import json_schema
from pagedserve.engine.runner import sampler as sampler_module
from pagedserve.engine.structured_output import compiler as compiler_module
from pagedserve.engine.structured_output import llguidance_backend

SCHEMAS = json.loads((Path(__file__).parent.parent / "tests" / "fixtures" / "service_schemas.json").read_text())
ASK = "Give a JSON record for a new user of our service: id, name, email, role, score, tags, country, date."


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class MaskClock:
    """Times the sampler's mask step and, inside it, the grammar library's fills (this process only)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []  # (constrained rows, fill s, whole mask step s)
        self._fill = 0.0
        self._rows = 0
        fill, mask = llguidance_backend.LLGuidanceMatcher.fill_bitmask, sampler_module.mask_constrained_rows

        def timed_fill(matcher, bitmask, row):
            start = time.perf_counter()
            fill(matcher, bitmask, row)
            self._fill += time.perf_counter() - start
            self._rows += 1

        def timed_mask(logits, seqs):
            self._fill, self._rows = 0.0, 0
            start = time.perf_counter()
            dead = mask(logits, seqs)
            if self._rows:
                self.steps.append((self._rows, self._fill, time.perf_counter() - start))
            return dead

        llguidance_backend.LLGuidanceMatcher.fill_bitmask = timed_fill
        sampler_module.mask_constrained_rows = timed_mask

    def summary(self) -> dict:
        fills = [f for _, f, _ in self.steps]
        applies = [w - f for _, f, w in self.steps]
        rows = [r for r, _, _ in self.steps]
        return {"steps": len(self.steps), "rows_median": statistics.median(rows) if rows else 0,
                "fill_ms_p50": 1e3 * percentile(fills, 0.5), "fill_ms_p90": 1e3 * percentile(fills, 0.9),
                "apply_ms_p50": 1e3 * percentile(applies, 0.5), "apply_ms_p90": 1e3 * percentile(applies, 0.9),
                "fill_us_per_row_p50": 1e6 * percentile([f / r for r, f, _ in self.steps], 0.5)}


def throughput(llm: LLM, n: int, repeats: int, clock: MaskClock) -> dict:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": ASK}])
    constrained = SamplingParams(temperature=0, max_tokens=300, constraint=json_schema(SCHEMAS["ten_fields"]))
    plain = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)] * (n - n // 2)
    first = llm.generate([prompt] * n, [constrained] * (n // 2) + plain)  # warm-up; fixes each twin's length
    lengths = [len(out.outputs[0].token_ids) for out in first[: n // 2]]
    twins = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    runs = {"constrained": [constrained] * (n // 2) + plain, "unconstrained": twins + plain}
    tokens = sum(lengths) + 64 * len(plain)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    clock.steps.clear()
    for _ in range(repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            outs = llm.generate([prompt] * n, params)
            seconds[name].append(time.perf_counter() - start)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
    tps = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    return {"requests": n, "constrained_requests": n // 2, "output_tokens": tokens,
            "constrained_output_tokens_median": statistics.median(lengths),
            "seconds": seconds, "tokens_per_s": tps, "ratio": tps["constrained"] / tps["unconstrained"]}


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    backend = engine.constraints.backend()
    setup = time.perf_counter() - start
    cold, cached = [], []
    for schema in SCHEMAS.values():
        fresh = compiler_module.ConstraintCompiler(lambda: backend, timeout_s=60)
        start = time.perf_counter()
        fresh.compile(json_schema(schema))
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.compile(json_schema(schema))
        cached.append(time.perf_counter() - start)
    return {"schemas": len(SCHEMAS), "backend_setup_s": setup,
            "cold_ms_p50": 1e3 * percentile(cold, 0.5), "cold_ms_p99": 1e3 * percentile(cold, 0.99),
            "cached_ms_p50": 1e3 * percentile(cached, 0.5), "cached_ms_p99": 1e3 * percentile(cached, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    llm = LLM(args.model, num_threads=args.threads)
    compile_result = compile_times(llm)
    clock = MaskClock()
    result = {
        "benchmark": "structured_outputs", "cpu": cpu_model(), "usable_cores": len(os.sched_getaffinity(0)),
        "threads": args.threads, "model": llm.engine.source.name, "backend": llm.engine.config.structured_output_backend,
        "compile": compile_result, "throughput": throughput(llm, args.requests, args.repeats, clock),
        "mask": clock.summary(), "load_before": load_before, "load_after": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
