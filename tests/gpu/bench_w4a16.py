"""bench_check.py's W4A16 section: every GPTQ/AWQ linear candidate at every size, against dense fp16, so the
thresholds of quant/w4a16_rule.py can be set from one run.

Per (format, K, N, M) row: `fp16_ms` (dense fp16 F.linear) and per candidate `ms`, `speedup_vs_fp16` (fp16_ms / ms;
targets: >= 2.5 at M = 1 and 16, >= 0.8 at 512 and 2048), `packed_gb_s` (qweight + scales + zeros bytes over ms) and
`fraction_of_copy` (of the device copy bandwidth; target >= 0.6 at M = 1, 16). Candidates:
- gemv / gemv_serial: the looped GEMV of quant/w4a16_gemv.py (up to 16 rows; partials summed by a second kernel / by
  the last program per tile);
- splitk_<settings>: the wide split-K GEMV of quant/w4a16_splitk.py (up to 16 rows) with each launch setting of
  SPLITK_SWEEP (block_n, block_k, k_steps, num_warps, num_stages, reduce[, _unpack: words loaded once; _inplace:
  fields masked where they lie; _half2: two codes an fp16x2 instruction; _pairs: 2-16 rows' codes made weights two
  at a time; _m32 / _m64: a 32- or 64-row tile, timed at 17 rows to its width]);
- w4a16_decode: the split-K Triton tile kernel forced at every M (partials summed by a second kernel);
  w4a16_decode_serial: the same with the serial reduction (the last program per tile sums; below 64 rows only,
  larger M falls back to the second kernel); w4a16_dense: dequantize once + cuBLAS; w4a16_dense_chunked: the same
  in column chunks of at most half the L2 through one buffer, each multiplied while still in L2 (above 16 rows);
  w4a16_dense_chunked_75: chunks of three quarters of the L2 (fewer, wider GEMMs); w4a16_fused / w4a16_fused_64:
  the weights made in pairs and scaled inside the GEMM (quant/w4a16_fused.py, 128- and 64-row tiles; above 16 rows);
- w4a16_rule: what the engine runs (RULE decides between the two);
- tinygemm_fp16: torch's int4 op with the fp16 activations cast to bf16 and back (what an fp16 model pays);
  tinygemm_bf16: the same on bf16 activations (what a bf16 model pays, no casts);
- triton_gemm: the previous per-element Triton kernel (quant/triton_gemm.py), for the record.
On CUDA each candidate is timed as CUDA-graph replays (launch overhead excluded, as in a captured decode step), each
timed call cycling through `weight_copies` copies of the weight that together exceed twice the L2 cache, so every
read comes from HBM as in a decode step over many layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.w4a16_rule import GEMV_MAX_ROWS, SPLITK_MAX_ROWS
from pagedserve.quant.packing import default_g_idx, pack_awq, pack_cols, pack_rows, unpack_awq

CANDIDATES = ("gemv", "w4a16_decode", "w4a16_decode_serial", "w4a16_dense", "w4a16_dense_chunked",
              "w4a16_dense_chunked_75", "w4a16_fused", "w4a16_fused_64", "w4a16_rule", "tinygemm_fp16",
              "tinygemm_bf16", "triton_gemm")
# The fused GEMM's second tile: half the rows, so M = 512 makes 2x the programs (256 at 4096 x 4096, against 132 SMs).
FUSED_64 = (64, 128, 64, 4, 3, 8)
# The split-K GEMV's launch settings, timed at M = 1 and 16: block_n, block_k, k_steps, num_warps, num_stages,
# reduce, unpack, in_place[, half2[, pairs]]. The _unpack, _inplace and _half2 ones change only the one-row path, so
# they run at M = 1 only; the _pairs ones only the 2-16-row path, so they run at M = 16 only.
# quant/w4a16_splitk.py's ONE_ROW and ROWS are the first and the tenth (chosen from the first device run's 15, where
# one row through tl.dot and the act-order permutation applied before the launch were slower); the _inplace ones mask
# each field where it lies (4.5-5.5 instructions a code against 5.9-6.3 for ONE_ROW in sm_90 code,
# benchmarks/w4a16_sass.py); the _half2 ones dequantize and multiply two codes an fp16x2 instruction (2.97-3.47 at
# ONE_ROW's tile, 2.70-3.02 at 1024 columns; 16-bit activations and 4 bits, others take the fp32 path); the _pairs
# ones make 2-16 rows' weights two codes at a time by permute, logic op and a pair op (quant/w4a16_pairs.py: 5.38
# and 4.91 instructions a code with and without the gather at ROWS's tile, against ROWS's 10.0 and 9.5; 4.2 and 3.8
# with the 64-row steps, 512 codes a thread; 16-bit activations and 4 bits, others take ROWS's path). The last four
# are wider tiles (block_m 64 and 32: the _m64 / _m32 names), timed only between 17 rows and their width, the band
# the rule now gives tinygemm (bf16) or dequantize + cuBLAS (fp16): one split-K launch reads the weights once for up
# to 64 rows where 17-32 rows cost two ROWS launches or a dense tile.
SPLITK_SWEEP = ((512, 32, 2, 2, 1, "last", True, False),
                (256, 64, 2, 4, 1, "last", True, False),
                (256, 32, 2, 2, 1, "last", True, False),
                (512, 64, 2, 4, 1, "last", True, False),
                (512, 32, 2, 2, 1, "last", True, True),
                (1024, 32, 2, 4, 1, "last", True, False),
                (1024, 32, 2, 2, 1, "last", True, True),
                (256, 32, 2, 2, 1, "atomic", True, False),
                (256, 32, 2, 2, 1, "atomic", False, False),
                (256, 32, 4, 4, 2, "last", False, False),
                (512, 32, 4, 4, 2, "last", False, False),
                (256, 64, 4, 4, 2, "last", False, False),
                (128, 32, 4, 4, 2, "last", False, False),
                (512, 32, 2, 1, 1, "last", True, True),
                (256, 32, 8, 4, 3, "last", False, False),
                (512, 32, 2, 2, 1, "last", True, False, True),
                (1024, 32, 2, 2, 1, "last", True, False, True),
                (256, 32, 4, 4, 2, "last", False, False, False, True),
                (256, 64, 4, 4, 2, "last", False, False, False, True),
                (256, 32, 2, 4, 2, "last", False, False, False, True),
                (128, 32, 4, 4, 2, "last", False, False, False, True, 64),
                (256, 32, 4, 8, 2, "last", False, False, False, True, 64),
                (256, 32, 4, 4, 2, "last", False, False, False, True, 32),
                (128, 32, 4, 4, 2, "last", False, False, False, False, 64))


@functools.cache
def sweep_rows() -> dict[str, tuple[int, int]]:
    """(fewest, most) rows each SPLITK_SWEEP launch is timed at: the one-row variants at 1, the pairs at 2-16, the
    rest of the 16-row tiles at every M up to 16, a wider tile from 17 rows to its width."""
    from pagedserve.quant.w4a16_splitk import SplitKConfig

    def rows(cfg: SplitKConfig) -> tuple[int, int]:
        if cfg.unpack or cfg.in_place or cfg.half2:
            return 1, 1
        if cfg.block_m > SPLITK_MAX_ROWS:
            return SPLITK_MAX_ROWS + 1, cfg.block_m
        return (2 if cfg.pairs else 1), SPLITK_MAX_ROWS

    return {cfg.name: rows(cfg) for cfg in (SplitKConfig(*c) for c in SPLITK_SWEEP)}


def device_weight(k: int, n: int, group: int, fmt: str, device: str, seed: int) -> GroupQuantWeight:
    """A random 4-bit weight made on the device (a 14336-wide one is slow to build on the CPU). AWQ goes through
    its checkpoint packing (interleaved along N) and the converter's unpacking, as a loaded AWQ layer does; GPTQ uses
    act-order (a random g_idx), the layout's worst case."""
    gen = torch.Generator(device).manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.int32)
    z = torch.randint(0, 16, (groups, n), generator=gen, device=device, dtype=torch.int32)
    s = (torch.rand(groups, n, generator=gen, device=device) * 0.02 + 0.002).half()
    g_idx = default_g_idx(k, group, torch.device(device))
    if fmt == "awq":
        q, z = unpack_awq(pack_awq(q)), unpack_awq(pack_awq(z))
    else:
        g_idx = g_idx[torch.randperm(k, generator=gen, device=device)]
    return GroupQuantWeight(pack_rows(q, 4), pack_cols(z, 4), s, g_idx, 4, k, n)


def candidates(w: GroupQuantWeight) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from pagedserve.quant import tinygemm, triton_gemm, w4a16_fused, w4a16_kernel, w4a16_splitk

    ours = w4a16_kernel.W4A16Kernel(w)
    configs = [w4a16_splitk.SplitKConfig(*c) for c in SPLITK_SWEEP]
    sweep = {c.name: lambda x, c=c: ours.splitk(x, c) for c in configs}
    tg = tinygemm.TinyGemmKernel(w) if tinygemm.unsupported_reason(w) is None else None
    fns = {"gemv": lambda x: ours(x, force="gemv"),
           "w4a16_decode": lambda x: ours(x, force="decode"),
           "w4a16_decode_serial": lambda x: ours(x, force="decode_serial"),
           "w4a16_dense": lambda x: ours(x, force="dense"), "w4a16_rule": ours,
           "w4a16_dense_chunked": lambda x: ours(x, force="dense_chunked"),
           "w4a16_dense_chunked_75": lambda x: ours(x, force="dense_chunked_75"),
           "w4a16_fused": lambda x: ours(x, force="fused"),
           "w4a16_fused_64": lambda x: w4a16_fused.fused_gemm(x if ours.perm is None else x.index_select(1, ours.perm),
                                                              ours.layout(), w4a16_fused.FusedConfig(*FUSED_64)),
           "triton_gemm": lambda x: triton_gemm.dequant_gemm(x, w)}
    if tg is not None:
        fns["tinygemm_fp16"] = tg
        fns["tinygemm_bf16"] = tg  # given bf16 activations by bench_row: no cast
    return {**{name: fns[name] for name in CANDIDATES if name in fns}, **sweep}


def packed_bytes(w: GroupQuantWeight) -> int:
    """What a decode kernel must read: 4-bit weights plus one scale and one zero per group and column."""
    return w.qweight.numel() * 4 + 2 * w.scales.numel() * w.scales.element_size()


def copies_past_l2(nbytes: int, device: str) -> int:
    """Weight copies a timed call cycles through so that none is still in L2 when it is read again (a decode step
    reads every layer once, far more than L2 holds); one on CPU (the dry run: the same loop over one copy, each
    interpreted call taking up to a second)."""
    if device != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(2, -(-2 * l2 // nbytes))


def timed(time_ms: Callable, fns: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> float:
    """ms per call of one copy: each timed call runs every copy once."""
    return time_ms(lambda: [fn(x) for fn in fns]) / len(fns)


def bench_row(fmt: str, w: GroupQuantWeight, prepared: list[tuple], m: int, copy: float, time_ms: Callable,
              device: str) -> dict:
    x = torch.randn(m, w.in_features, device=device, dtype=torch.float16)
    x_bf16 = x.to(torch.bfloat16)
    fp16_ms = timed(time_ms, [lambda x, d=dense: torch.nn.functional.linear(x, d) for dense, _ in prepared], x)
    row: dict = {"format": fmt, "m": m, "k": w.in_features, "n": w.out_features, "bits": 4,
                 "fp16_ms": round(fp16_ms, 4), "weight_copies": len(prepared), "candidates": {}}
    nbytes = packed_bytes(w)
    for name in prepared[0][1]:
        fewest, most = sweep_rows().get(name, (1, GEMV_MAX_ROWS if name.startswith("gemv") else 1 << 30))
        prefill_only = name == "triton_gemm" or name.startswith(("w4a16_dense_chunked", "w4a16_fused"))
        if not fewest <= m <= most or prefill_only and m <= SPLITK_MAX_ROWS:
            continue  # outside the launch's rows (sweep_rows; the GEMVs hold 16); triton_gemm's decode rows: 0.03-0.05x
        try:
            ms = timed(time_ms, [fns[name] for _, fns in prepared], x_bf16 if name == "tinygemm_bf16" else x)
        except Exception as exc:  # a candidate that cannot run here is reported, the others still run
            row["candidates"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        gb_s = nbytes / (ms * 1e-3) / 1e9
        row["candidates"][name] = {"ms": round(ms, 4), "speedup_vs_fp16": round(fp16_ms / ms, 3),
                                   "packed_gb_s": round(gb_s, 1), "fraction_of_copy": round(gb_s / copy, 3)}
    times = {k: v["ms"] for k, v in row["candidates"].items() if "ms" in v}
    row["fastest"] = min(times, key=times.get) if times else None
    return row


def w4a16_gemm(shapes: tuple[tuple[int, int], ...], ms: tuple[int, ...], awq_shape: tuple[int, int], group: int,
               copy: float, time_ms: Callable, device: str) -> Iterator[dict]:
    """One row at a time, so the caller can write each as it comes: the sweep is the bench stage's longest part, and a
    stage that runs out of budget keeps the rows it measured."""
    for fmt, k, n in [("gptq", k, n) for k, n in shapes] + [("awq", *awq_shape)]:
        w = device_weight(k, n, group, fmt, device, seed=k + n)
        prepared = []
        for i in range(copies_past_l2(packed_bytes(w), device)):
            wi = w if i == 0 else device_weight(k, n, group, fmt, device, seed=k + n + i)
            prepared.append((wi.dequantize(torch.float16), candidates(wi)))
        for m in ms:
            yield bench_row(fmt, w, prepared, m, copy, time_ms, device)
        del w, prepared
        if device == "cuda":
            torch.cuda.empty_cache()
