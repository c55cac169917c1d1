"""benchmarks/kv_long_context.py's interleaved mode: engines stepped in turn in one process schedule exactly as
they do alone (the same steps, preemptions and peak), each timed on its own clock, within the wall time."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kv_long_context as bench  # noqa: E402

KVS = ["bf16", "int8"]
MEMORY = 3 << 20  # a few blocks: the bf16 cache queues, the int8 one preempts


def test_interleaved_engines_schedule_as_alone():
    prompts = bench.workload(3, 48, 96, seed=1)
    start = time.perf_counter()
    together = bench.run_interleaved(KVS, MEMORY, prompts, 12, 8, block_size=16)
    wall = time.perf_counter() - start
    alone = {kv: bench.run(kv, MEMORY, prompts, 12, 8, block_size=16) for kv in KVS}
    for kv in KVS:
        for key in ("steps", "preemptions", "peak_running", "blocks", "prompt_tokens", "output_tokens"):
            assert together[kv][key] == alone[kv][key], (kv, key)
        assert 0 < together[kv]["ttft_mean_s"] <= together[kv]["seconds"]
    assert sum(together[kv]["seconds"] for kv in KVS) <= wall
    assert together["bf16"]["peak_running"] == 1 and together["int8"]["preemptions"] >= 1  # the workload's point
