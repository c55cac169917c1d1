"""The host's share of a decode step, the part a GPU does not speed up (never in CI).

    python benchmarks/host_step.py --batch 1 --steps 200 [--repeat 5] [--profile]

A tiny random Llama (transformers config, the default model's 49152-token vocabulary) decodes `batch` requests in
lockstep (greedy, ignore_eos) on the torch path (native step off): the path a CUDA decode step takes, with the eager
forward where a GPU replays its graph. Each decode step is split by wrapping this engine's own components:
schedule, prepare (the step's inputs), eager_forward (forward, the model from embedding to final norm: the graph's
work on a GPU, plus the eager path's metadata and attention plan, `eager_inputs`, which a graphed step skips),
lm_head (compute_logits: device work on a GPU too), sample, update, and `other`, the rest of step() (outputs,
glue). `graph_inputs` is what a graphed step builds instead of eager_inputs (pad_decode and the static buffers'
load, `DecodeGraphs._load` on a CPU DecodeGraphs), run after prepare. `host` = step - eager_forward - lm_head: a
graphed step's host work, the part a faster device does not shorten. Prints one JSON object of medians (ms per
step) per repeat, with the load average; --profile adds a cProfile of the last repeat (top 25 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_cost import tiny_llama  # noqa: E402

PHASES = ("schedule", "prepare", "graph_inputs", "eager_forward", "lm_head", "sample", "update")


class Phases:
    """Per step, the seconds spent in each wrapped call (this engine instance only). `eager_forward` holds
    `forward` (the model) and the eager path's own inputs (metadata tensors, attention plan), which a graphed step
    does not build; `graph_inputs` is what it builds instead, timed after prepare on a CPU DecodeGraphs."""

    def __init__(self, engine) -> None:
        from pagedserve.engine.runner.cuda_graphs import DecodeGraphs, GraphModel

        self.now: dict[str, float] = defaultdict(float)
        runner = engine.runner
        target = GraphModel(runner.model, runner.kv_cache, runner.attn_impl, runner.layer_ops, runner.windows)
        self.graphs = DecodeGraphs(target, (1, 2, 4, 8, 16), runner.max_model_len, runner.device)
        for owner, attr, label in ((engine.scheduler, "schedule", "schedule"), (runner, "prepare", "prepare"),
                                   (runner, "_eager_forward", "eager_forward"), (runner.model, "forward", "forward"),
                                   (runner.model, "compute_logits", "lm_head"), (runner, "sampler", "sample"),
                                   (engine.scheduler, "update", "update")):
            setattr(owner, attr, self._timed(getattr(owner, attr), label))
        runner.prepare = self._with_graph_inputs(runner.prepare)

    def _timed(self, inner, label: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[label] += time.perf_counter() - t0
        return timed

    def _with_graph_inputs(self, prepare):
        from pagedserve.engine.runner.graph_inputs import pad_decode

        def prepared(batch):
            step = prepare(batch)
            t0 = time.perf_counter()
            padded = pad_decode(step, self.graphs.sizes, self.graphs.max_blocks)
            if padded is not None:
                self.graphs._load(padded)
            self.now["graph_inputs"] += time.perf_counter() - t0
            return step
        return prepared


def decode(engine, batch: int, steps: int, tag: str, profiler: cProfile.Profile | None) -> list[dict[str, float]]:
    from pagedserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [100 + (7 * i + j) % 30000 for j in range(16)], params)
    engine.step()  # prefill
    phases = engine._phases
    rows = []
    while engine.has_unfinished_requests():
        phases.now.clear()
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        row = {"step": total, **{p: phases.now.get(p, 0.0) for p in (*PHASES, "forward")}}
        row["other"] = total - sum(row[p] for p in PHASES)
        row["eager_inputs"] = row["eager_forward"] - row["forward"]
        row["host"] = total - row["eager_forward"] - row["lm_head"]  # a graphed step's host work
        rows.append(row)
    return rows


def build(folder: Path, batch: int, steps: int):
    from pagedserve.engine import EngineConfig, LLMEngine

    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=steps + 64, max_num_seqs=max(batch, 16),
                          enable_prefix_caching=False, native_step_max_batch=0, kv_cache_memory=64 << 20)
    engine = LLMEngine(config)
    engine._phases = Phases(engine)
    return engine


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows) * 1e3, 4) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # the host's work is one thread's; a quiet second core keeps the noise down
    load_before = os.getloadavg()
    out: dict = {"batch": args.batch, "steps": args.steps, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(tiny_llama(Path(tmp), max_positions=args.steps + 128), args.batch, args.steps)
        decode(engine, args.batch, 8, "warm", None)
        for r in range(args.repeat):
            profiler = cProfile.Profile() if args.profile and r == args.repeat - 1 else None
            out["runs"].append(summary(decode(engine, args.batch, args.steps, f"r{r}", profiler)))
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    out["load_avg_before"], out["load_avg_after"] = load_before, os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
