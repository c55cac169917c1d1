"""Benchmarks of the CUDA path, printed and written as JSON (numbers, never assertions; docs/gpu.md has the table).

    python3 tests/gpu/bench_check.py --out bench.json [--dry-run]

- copy_gb_s: a device-to-device copy, bytes read + written per second: the bandwidth ceiling actually reachable;
- decode_attention: the Triton decode paths' achieved bandwidth (benchmarks/attention_kernel.py's byte count) on
  Llama-3-8B-shaped layers with fp16, FP8 and int8 caches, and their fraction of copy_gb_s (target >=
  decode_attention_target): the unified kernel, the decode kernel in one pass and split, a tile sweep
  (tests/gpu/bench_decode.py);
- dequant_gemm: the Triton GPTQ 4-bit dequant-GEMM against torch's fp16 matmul of the dense weight, at decode
  (M = 1, 16) and prefill (M = 512, 2048) shapes;
- w4a16_gemm: every GPTQ/AWQ 4-bit linear candidate (the w4a16 decode kernel, dequantize + cuBLAS, tinygemm, the
  previous Triton GEMM) at every M against dense fp16, timed as CUDA-graph replays (bench_w4a16.py);
- e2e_tokens_per_s: generated tokens per second of a tiny random Llama (64 prompts at once, bf16, Triton attention),
  with the decode step's CUDA graphs; e2e_tokens_per_s_eager: the same with enforce_eager (the host-bound step).
--dry-run: CPU, Triton's interpreter, tiny shapes and few repeats: the same fields, meaningless numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import tiny_models
import triton_interpreter_patch  # from tests/, which tiny_models puts on sys.path
from quant_fixtures import random_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode  # noqa: E402  (imports benchmarks/attention_kernel.py)
import bench_w4a16  # noqa: E402

DECODE_TARGET = 0.8


@dataclass(frozen=True, slots=True)
class Scale:
    device: str
    copy_bytes: int
    attention: tuple[tuple[int, int], ...]  # (batch, context)
    attention_sweep: tuple[int, ...]  # the `attention` shapes the tile sweep (bench_decode.SWEEP) runs at
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    gemm_shapes: tuple[tuple[int, int], ...]  # (K, N)
    gemm_m: tuple[int, ...]
    w4a16_shapes: tuple[tuple[int, int], ...]  # (K, N), GPTQ act-order group `w4a16_group`
    w4a16_awq: tuple[int, int]  # the one AWQ (K, N)
    w4a16_group: int
    e2e: tuple[int, int, int]  # prompts, prompt length, new tokens
    e2e_model: tuple[int, int]  # hidden size, layers
    repeats: int


GPU = Scale("cuda", 1 << 30, ((64, 4096), (16, 16384), (1, 32768)), (0, 1), (32, 8, 128),
            ((4096, 4096), (4096, 14336)), (1, 16, 32, 512, 2048), ((4096, 4096), (4096, 14336), (14336, 4096)),
            (4096, 14336), 128, (64, 32, 64), (256, 4), 50)
# 96 x 64 with 32-row groups: act-order, and a K that splits; tinygemm runs on torch's CPU op.
# One timed call per path: under Triton's interpreter the numbers are meaningless and nothing compiles, so a
# warm-up or a median of several calls would only repeat the same interpreted kernel run. The attention tile sweep
# runs at the shorter shape only (the longer one's sweep took ~25 s of interpreted calls).
DRY = Scale("cpu", 1 << 23, ((2, 300), (1, 40)), (1,), (4, 2, 16), ((64, 64),), (1, 16, 32), ((96, 64),), (64, 64), 32,
            (2, 8, 3), (64, 2), 1)


def median_ms(fn: Callable[[], object], scale: Scale) -> float:
    """Median of `repeats` timed calls after warm-up (CUDA events through triton's do_bench on the GPU; no warm-up
    on CPU, the dry run, where nothing compiles)."""
    if scale.device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    samples = []
    for _ in range(scale.repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graph_ms(fn: Callable[[], object], scale: Scale) -> float:
    """Median ms of CUDA-graph replays of fn (launch overhead excluded, as in a captured decode step; a launch that
    cannot be captured raises, and bench_w4a16 reports it as that candidate's error); median_ms on CPU."""
    if scale.device != "cuda":
        return median_ms(fn, scale)
    import triton.testing

    fn()  # compile outside the capture
    # rep: ms of unrolled calls per captured graph (about 2000 of a 5 us decode GEMM), keeping the section near 60 s
    return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")


def copy_gb_s(scale: Scale) -> float:
    src = torch.randn(scale.copy_bytes // 4, device=scale.device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), scale)
    return round(2 * scale.copy_bytes / (ms * 1e-3) / 1e9, 1)


def fp8_name(scale: Scale) -> str:
    e4m3 = scale.device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
    return "fp8_e4m3" if e4m3 else "fp8_e5m2"


def decode_attention(scale: Scale, copy: float) -> list[dict]:
    """fp16, FP8 and int8 caches through every decode path (bench_decode.py)."""
    def time_ms(fn: Callable[[], object]) -> float:
        if scale.device == "cuda":  # shorter than median_ms's: 3 dtypes x 3 shapes x 3+ paths stay within ~40 s
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        return median_ms(fn, scale)

    return bench_decode.decode_attention_rows(scale.device, scale.attention, scale.heads, fp8_name(scale), copy,
                                              time_ms, scale.attention_sweep)


def dequant_gemm(scale: Scale) -> list[dict]:
    from pagedserve.quant.triton_gemm import dequant_gemm as triton_gemm

    rows = []
    for k, n in scale.gemm_shapes:
        w = random_weight(k, n, 4, 128 if k >= 128 else 32, False, seed=k + n)
        w = type(w)(*(t.to(scale.device) for t in (w.qweight, w.qzeros, w.scales, w.g_idx)), w.bits, k, n)
        dense = w.dequantize(torch.float16).to(scale.device)
        packed_bytes = sum(t.numel() * t.element_size() for t in (w.qweight, w.qzeros, w.scales, w.g_idx))
        for m in scale.gemm_m:
            x = torch.randn(m, k, device=scale.device, dtype=torch.float16)
            ours = median_ms(lambda: triton_gemm(x, w), scale)
            dense_ms = median_ms(lambda: torch.nn.functional.linear(x, dense), scale)
            rows.append({"m": m, "k": k, "n": n, "bits": 4, "triton_ms": round(ours, 4),
                         "torch_fp16_ms": round(dense_ms, 4),
                         "speedup_vs_fp16": round(dense_ms / ours, 3),
                         "triton_weight_gb_s": round(packed_bytes / (ours * 1e-3) / 1e9, 1),
                         "triton_tflops": round(2 * m * k * n / (ours * 1e-3) / 1e12, 2)})
    return rows


def e2e_tokens_per_s(scale: Scale, enforce_eager: bool = False, async_scheduling: bool = False) -> float:
    from pagedserve.engine import LLM, SamplingParams

    count, length, new = scale.e2e
    with tempfile.TemporaryDirectory() as tmp:
        hidden, layers = scale.e2e_model
        model = tiny_models.make_tiny(Path(tmp) / "llama", hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_attention_heads=hidden // 32, num_key_value_heads=2, num_hidden_layers=layers)
        llm = LLM(str(model), device=scale.device, attention_backend="triton", dtype="bfloat16",
                  kv_cache_memory=1 << 26, max_num_batched_tokens=2048, enforce_eager=enforce_eager,
                  async_scheduling=async_scheduling)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, tiny_models.VOCAB, (length,), generator=gen).tolist() for _ in range(count)]
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        # Warm up at the timed batch size: compiles every kernel and launch shape the timed run uses (a 2-prompt
        # warm-up left one-time work in the timed run: graphs timed 8234 tokens/s where a profiled rerun took 0.29 s
        # of host time against eager's 0.53 s).
        llm.generate(prompts, params)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        host_profile(llm, prompts, params, "eager" if enforce_eager else "async" if async_scheduling else "graphs")
    return round(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, 1)


def host_profile(llm, prompts: list, params, label: str, top: int = 14) -> None:
    """Where the host spends a run of this host-bound model (the log only): the functions with the most own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"host profile ({label}):", "\n".join(text.getvalue().splitlines()[:top + 12]), sep="\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    triton_interpreter_patch.install()  # the dry run's interpreter only: a GPU run compiles, and this does nothing
    scale = DRY if args.dry_run else GPU
    if scale.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    result: dict = {"device": scale.device, "decode_attention_target": DECODE_TARGET}
    result["copy_gb_s"] = copy_gb_s(scale)
    print(f"copy: {result['copy_gb_s']} GB/s", flush=True)
    result["decode_attention"] = decode_attention(scale, result["copy_gb_s"])
    fractions = [r["fraction_of_copy"] for r in result["decode_attention"] if "fraction_of_copy" in r]
    result["decode_attention_best_fraction"] = max(fractions, default=None)
    args.out.write_text(json.dumps(result, indent=1))
    for row in result["decode_attention"]:
        print("decode attention", row, flush=True)
    result["dequant_gemm"] = dequant_gemm(scale)
    args.out.write_text(json.dumps(result, indent=1))
    for row in result["dequant_gemm"]:
        print("dequant gemm", row, flush=True)
    result["w4a16_gemm"] = []
    for row in bench_w4a16.w4a16_gemm(scale.w4a16_shapes, scale.gemm_m, scale.w4a16_awq, scale.w4a16_group,
                                      result["copy_gb_s"], lambda fn: graph_ms(fn, scale), scale.device):
        result["w4a16_gemm"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
        print("w4a16 gemm", json.dumps(row), flush=True)
    result["e2e_tokens_per_s"] = e2e_tokens_per_s(scale)
    result["e2e_tokens_per_s_eager"] = e2e_tokens_per_s(scale, enforce_eager=True)
    result["e2e_tokens_per_s_async"] = e2e_tokens_per_s(scale, async_scheduling=True)
    print(f"e2e: {result['e2e_tokens_per_s']} tokens/s ({result['e2e_tokens_per_s_eager']} with enforce_eager, "
          f"{result['e2e_tokens_per_s_async']} with async scheduling)", flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if fractions and len(fractions) == len(result["decode_attention"]) else 1


if __name__ == "__main__":
    sys.exit(main())
