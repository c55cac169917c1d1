"""setup.sh's last step: start llama-server and vLLM's OpenAI server on loopback, ask each for one short
completion and stop it; exits non-zero, naming the system and its log, if either does not answer.

    python benchmarks/peers/smoke.py --model MODEL_DIR [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from http_client import Endpoint, run_http  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

import paths  # noqa: E402
import servers  # noqa: E402

ONE = WorkloadConfig(num_requests=1, prompt_len_min=8, prompt_len_max=8, output_len_min=4, output_len_max=4)


def _ask(server: servers.Server, endpoint: Endpoint) -> None:
    timings = run_http(endpoint, build_workload(ONE))
    got = sum(t.num_output_tokens for t in timings)
    if got != ONE.output_len_max:
        raise RuntimeError(f"{server.name} answered {got} tokens, asked for {ONE.output_len_max}; see {server.log_path}")


def smoke(name: str, start, endpoint_of) -> bool:
    server = None
    try:
        server = start()
        _ask(server, endpoint_of(server))
        print(f"smoke: {name} answered one completion ({server.target})", flush=True)
        return True
    except Exception as exc:  # report every system, then fail loudly
        print(f"smoke: {name} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--log-dir", type=Path, default=None, help="default: <peers cache>/logs/smoke")
    args = p.parse_args()
    log_dir = args.log_dir or paths.peers_cache() / "logs" / "smoke"
    ok = smoke("llama-server", lambda: servers.start_llama_server(args.model, args.dtype, log_dir, parallel=1),
               lambda s: Endpoint(s.target + "/completion", "model", (("cache_prompt", False),), style="llama"))
    ok &= smoke("vLLM", lambda: servers.start_vllm(args.model, args.dtype, log_dir, kv_gib=1),
                lambda s: Endpoint(s.target + "/v1/completions", "model", (("return_token_ids", True),)))
    if not ok:
        raise SystemExit("smoke: a peer did not answer; setup is not complete (logs under " + str(log_dir) + ")")


if __name__ == "__main__":
    main()
