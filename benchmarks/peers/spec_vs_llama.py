"""N-gram speculative decoding against llama-server's own on the same GGUF file and copy workload (never in CI).

    python benchmarks/peers/spec_vs_llama.py      # default Q4_1 GGUF, concurrency 1 and 4, 192 tokens, 3 repeats

The copy workload of benchmarks/spec_decode.py (rewrite a chunk of Python's LICENSE.txt, 300-1,000 tokens, changing
one word) as streamed OpenAI chat requests, greedy, EOS ignored, sent `concurrency` at a time. Four servers, one at a
time: pagedserve's OpenAI HTTP API without and with `--speculative-config` (ngram, k=4, lookup 2-4), llama-server
without and with `--spec-type ngram-simple` (lookup n=3, draft m=4). Per request the inter-token latency is (last
chunk - first chunk) / (tokens - 1); medians over requests and repeats. Printed: one JSON object with the CPU model,
load average before and after, each server's ITL and the speed-up speculation gives each system, and pagedserve's
ITL against llama-server's, both speculating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import servers  # noqa: E402
from compare import host_info  # noqa: E402
from hf_folder import hf_folder  # noqa: E402
from spec_decode import ASK, license_chunks  # noqa: E402

PAGEDSERVE_SPEC = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
LLAMA_SPEC = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4")


class TokenizerOnly:
    """What license_chunks reads of an LLM: its tokenizer's encode/decode (the model's own, from its HF folder)."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))


def stream_itl(url: str, text: str, max_tokens: int) -> float:
    body = {"model": "model", "messages": [{"role": "user", "content": ASK.format(text=text)}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    times, tokens = [], None
    with urllib.request.urlopen(request, timeout=900) as reply:
        for line in reply:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    if tokens is None or tokens < 2 or len(times) < 2:
        raise RuntimeError(f"{url}: {tokens} tokens in {len(times)} chunks")
    return (times[-1] - times[0]) / (tokens - 1)


def measure(url: str, texts: list[str], concurrency: int, max_tokens: int, repeats: int) -> dict:
    stream_itl(url, texts[0][:200], 8)  # warm-up
    itls = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(repeats):
            itls += pool.map(lambda t: stream_itl(url, t, max_tokens), texts[:concurrency])
    return {"itl_ms_median": 1e3 * statistics.median(itls), "itl_ms": [round(1e3 * x, 2) for x in itls]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-spec-vs-llama"))
    args = parser.parse_args()
    from pagedserve.engine.loading.model_store import resolve_model

    info = host_info()
    gguf = Path(args.gguf) if args.gguf else resolve_model(None).weights
    texts = license_chunks(TokenizerOnly(hf_folder(None)), max(args.concurrency))
    threads = len(os.sched_getaffinity(0))
    starters = {
        "pagedserve": lambda: servers.start_pagedserve(str(gguf), "bfloat16", args.log_dir, threads, http=True),
        "pagedserve-spec": lambda: servers.start_pagedserve(str(gguf), "bfloat16", args.log_dir, threads, http=True,
                                                            extra_args=PAGEDSERVE_SPEC),
        "llama-server": lambda: servers.start_llama_server("", "bfloat16", args.log_dir, threads, max(args.concurrency),
                                                           2048, gguf=gguf),
        "llama-server-spec": lambda: servers.start_llama_server("", "bfloat16", args.log_dir, threads,
                                                                max(args.concurrency), 2048, gguf=gguf,
                                                                extra_args=LLAMA_SPEC),
    }
    results: dict[str, dict] = {}
    llama_build = None
    for name, start in starters.items():
        server = start()
        llama_build = llama_build or (asdict(server.llama) if server.llama else None)
        try:
            results[name] = {str(c): measure(server.target, texts, c, args.max_tokens, args.repeats)
                             for c in args.concurrency}
        finally:
            server.stop()
    info["load_avg_1m_end"] = os.getloadavg()[0]
    itl = {name: {c: r["itl_ms_median"] for c, r in per.items()} for name, per in results.items()}
    speedups = {c: {"pagedserve": itl["pagedserve"][c] / itl["pagedserve-spec"][c],
                    "llama-server": itl["llama-server"][c] / itl["llama-server-spec"][c],
                    "pagedserve_spec_itl_over_llama_spec_itl": itl["pagedserve-spec"][c] / itl["llama-server-spec"][c]}
                for c in map(str, args.concurrency)}
    print(json.dumps({"benchmark": "spec_vs_llama", "host": info, "gguf": str(gguf), "max_tokens": args.max_tokens,
                      "llama_build": llama_build, "pagedserve_spec": PAGEDSERVE_SPEC[1],
                      "llama_spec": " ".join(LLAMA_SPEC), "speedups": speedups, "results": results}, indent=1))


if __name__ == "__main__":
    main()
