"""pagedserve's OpenAI HTTP API vs its gRPC API: one server process (one engine), the same seeded workload,
runs alternating between the protocols. Never in CI; the machine should be quiet.

    python benchmarks/http_vs_grpc.py                  # the default workload, 3 repeats per protocol
    python benchmarks/http_vs_grpc.py --quick          # a smoke test of the harness

The HTTP side uses the same stdlib SSE client and request body as the vLLM comparison (benchmarks/peers), the gRPC
side the project's asyncio client. Prints one JSON object: medians per protocol, http/grpc ratios, and whether
both produced the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from metrics import median_result, summarize, token_agreement  # noqa: E402
from workload import QUICK, add_workload_args, build_workload, workload_config_from_args  # noqa: E402

import paths  # noqa: E402
import servers  # noqa: E402
from grpc_client import run_grpc  # noqa: E402
from http_client import Endpoint, run_http  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 small requests, 1 repeat")
    p.add_argument("--log-dir", type=Path, default=paths.peers_cache() / "logs")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from hf_folder import hf_folder

    model_dir = str(hf_folder(args.model))
    config = QUICK if args.quick else workload_config_from_args(args)
    workload = build_workload(config)
    server = servers.start_pagedserve(model_dir, args.dtype, args.log_dir, args.threads, http=True)
    endpoint = Endpoint(server.target + "/v1/completions", "model", (("return_token_ids", True),))
    protocols = {"grpc": lambda w: run_grpc(server.grpc_target, w), "http": lambda w: run_http(endpoint, w)}
    runs: dict[str, list] = {name: [] for name in protocols}
    timings: dict[str, list] = {}
    try:
        warmup = build_workload(QUICK)
        for run in protocols.values():
            run(warmup)
        for rep in range(1 if args.quick else args.repeats):
            for name in list(protocols)[rep % 2:] + list(protocols)[:rep % 2]:
                timings[name] = protocols[name](workload)
                runs[name].append(summarize(name, args.dtype, timings[name], workload.num_prompt_tokens))
    finally:
        server.stop()
    medians = {name: median_result(r) for name, r in runs.items()}
    http, grpc = medians["http"], medians["grpc"]
    print(json.dumps({
        "workload": workload.summary(), "dtype": args.dtype, "threads": args.threads, "median": medians,
        "http_vs_grpc": {"output_tok_s_ratio": http["output_tok_s"] / grpc["output_tok_s"],
                         "ttft_p50_ratio": http["ttft_p50_s"] / grpc["ttft_p50_s"],
                         "itl_p50_ratio": http["itl_p50_ms"] / grpc["itl_p50_ms"]},
        "token_agreement": token_agreement(timings["http"], timings["grpc"]),
    }, indent=2))


if __name__ == "__main__":
    main()
