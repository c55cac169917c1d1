"""The packed GGUF kernels at SmolLM2-135M's own shapes and tensors, and one stream end to end: JSON lines.

Kernels: each matrix of the default Q4_1 file's first layer (q/k/v and gate/up merged as the engine merges them)
and its Q8_0 LM head (the tied embedding), at 1, 4, 8 and 32 rows, through
  packed_fp32  the packed kernel, fp32 activations (the engine's choice up to quant/gguf.py's PACKED_MAX_ROWS rows),
  packed_int8  the same kernel with activations rounded to int8 per 32 values (integer dot products),
  dequant_bf16 dequantizing the matrix to bf16 per call, then torch's matmul (the engine's choice above it),
  dense_bf16   torch's bf16 matmul on weights expanded at load (the dequantized path, oneDNN-packed as it serves),
with microseconds per call (best of --repeats) and GB/s of the weight bytes each one reads.
With --group, the same shapes (LM head left out) through the GPTQ/AWQ kernel (quant/cpu_group_kernel.py) on
random GroupQuantWeights made by the same packing code: group_gptq (4-bit g128, act-order), group_awq (4-bit g64),
group_gptq8 (8-bit g128) in the layout the loader serves with that build (rows interleaved in groups of 16 where it
has AVX-512; then also *_rowwise, one row after another), beside the Q4_1 packed kernel at that shape in the file's
layout (packed_q4_1) and with rows grouped (packed_q4_1_grouped: what quant/gguf.py serves where the build has
AVX-512). `--group-tier` builds the kernels for another ISA tier (kernels/cpu/isa.py), e.g. to compare them.
PAGEDSERVE_CPU_ISA=avx2 runs everything on the AVX2 tier's build; every line records the tier ("tier") it ran.
End to end (--e2e): `LLM.generate` of one request, 256 tokens, EOS ignored, packed vs dequantized, interleaved,
best of --e2e-repeats, output tokens per second.

    python benchmarks/packed_gemv.py                  # kernels, all usable threads
    python benchmarks/packed_gemv.py --e2e            # and the end-to-end single stream
    python benchmarks/packed_gemv.py --grouped-ab --rows 1 2 4 8 16   # interleaved rows: 16-lane VNNI vs 8-lane build
    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/packed_gemv.py          # the AVX2 tier on any AVX2 host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.engine.loading.model_store import resolve_model  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402
from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.group_packed import FAST_GROUP_GROUPED_ISAS  # noqa: E402
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear  # noqa: E402

# (name, GGUF tensors concatenated by rows, as the engine merges them)
MATRICES = (("qkv", ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")),
            ("o", ("blk.0.attn_output.weight",)), ("gate_up", ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")),
            ("down", ("blk.0.ffn_down.weight",)), ("lm_head", ("token_embd.weight",)))


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def matrices(path: Path) -> list[tuple[str, str, torch.Tensor, int]]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = []
    for name, parts in MATRICES:
        qtype = tensors[parts[0]].tensor_type.name
        blocks = torch.from_numpy(np.concatenate([np.array(tensors[p].data) for p in parts]))
        out.append((name, qtype, blocks, int(tensors[parts[0]].shape[0])))
    return out


def kernel_rows(path: Path, rows_list: list[int], repeats: int) -> None:
    for name, qtype, blocks, in_features in matrices(path):
        fp32 = cpu_packed.PackedMatrix(qtype, blocks, in_features)
        int8 = cpu_packed.PackedMatrix(qtype, blocks, in_features, int8_max_rows=1 << 30)
        dense = fp32.dequantize(dtype=torch.bfloat16)
        packed_dense = pack_weight(dense) if can_pack(dense) else None
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            xb = x.bfloat16()
            calls = {
                "packed_fp32": (lambda: fp32.matmul(x), blocks.numel()),
                "packed_int8": (lambda: int8.matmul(x), blocks.numel()),
                "dequant_bf16": (lambda: torch.nn.functional.linear(xb, fp32.dequantize(dtype=torch.bfloat16)),
                                 blocks.numel()),
                "dense_bf16": ((lambda: packed_linear(xb, packed_dense, None)) if packed_dense is not None
                               else (lambda: torch.nn.functional.linear(xb, dense)), dense.numel() * 2),
            }
            for kernel, (fn, nbytes) in calls.items():
                us = best_us(fn, repeats)
                print(json.dumps({"kind": "kernel", "matrix": name, "type": qtype, "in": in_features,
                                  "out": blocks.shape[0], "rows": rows, "kernel": kernel, "us": round(us, 1),
                                  "gb_s": round(nbytes / us / 1e3, 2), "threads": torch.get_num_threads(),
                                  "tier": library_tier(fp32.lib), "cpu": cpu_model()}), flush=True)


def group_rows(path: Path, rows_list: list[int], repeats: int, tier: str | None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quant_fixtures import random_weight

    from pagedserve.quant.cpu_group_kernel import repack

    lib = cpu_packed.build(tier)
    for name, qtype, blocks, in_features in matrices(path):
        if name == "lm_head":
            continue
        out = blocks.shape[0]
        q4_1 = cpu_packed.PackedMatrix(qtype, blocks, in_features, lib=lib)
        kernels = {f"packed_{qtype.lower()}": (q4_1.matmul, blocks.numel())}
        # as quant/gguf.py serves
        if q4_1.can_group(qtype, blocks) and cpu_packed.grouped_isa(lib) in cpu_packed.FAST_GROUPED_ISAS:
            grouped = cpu_packed.PackedMatrix(qtype, blocks.clone(), in_features, lib=lib).grouped()  # in place
            kernels[f"packed_{qtype.lower()}_grouped"] = (grouped.matmul, blocks.numel())
        for kind, bits, group, act_order in (("group_gptq", 4, 128, True), ("group_awq", 4, 64, False),
                                             ("group_gptq8", 8, 128, True)):
            m = dataclasses.replace(repack(random_weight(in_features, out, bits, group, act_order), group_rows=False),
                                    lib=lib)
            if out % cpu_packed.GROUP_ROWS == 0 and cpu_packed.group_grouped_isa(lib) in FAST_GROUP_GROUPED_ISAS:
                kernels[f"{kind}_rowwise"] = (m.matmul, m.nbytes())  # the layout before rows were grouped
                m = m.grouped()  # what repack serves with this build
            kernels[kind] = (m.matmul, m.nbytes())
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            for kernel, (fn, nbytes) in kernels.items():
                us = best_us(lambda: fn(x), repeats)
                print(json.dumps({"kind": "group_kernel", "matrix": name, "in": in_features, "out": out, "rows": rows,
                                  "kernel": kernel, "us": round(us, 1), "gb_s": round(nbytes / us / 1e3, 2),
                                  "tier": library_tier(lib), "isa": cpu_packed.group_grouped_isa(lib),
                                  "threads": torch.get_num_threads(), "cpu": cpu_model()}), flush=True)


def grouped_ab(path: Path, rows_list: list[int], repeats: int, tier: str) -> None:
    """The interleaved-rows kernels of two builds, -march=native (A) and ISA tier `tier` (B; default avx512: the
    8-lane int16 kernel), at every shape (LM head included) and row count, A and B calls
    interleaved and the best of each kept: noise on a shared machine hits both alike. The GGUF matrices are the
    file's; GPTQ/AWQ ones random at the same shape (4-bit g128 act-order, 8-bit g128)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quant_fixtures import random_weight

    from pagedserve.quant.cpu_group_kernel import repack

    libs = {"A": cpu_packed.build("native"), "B": cpu_packed.build(tier)}
    isas = {k: cpu_packed.grouped_isa(lib) for k, lib in libs.items()}
    for name, qtype, blocks, in_features in matrices(path):
        out = blocks.shape[0]
        kernels = {f"gguf_{qtype.lower()}": {k: cpu_packed.PackedMatrix(qtype, blocks.clone(), in_features, lib=lib)
                                             .grouped().matmul for k, lib in libs.items()}}
        for kind, bits in (("gptq4", 4), ("gptq8", 8)):
            if name == "lm_head":
                continue
            base = repack(random_weight(in_features, out, bits, 128, True), group_rows=False)
            kernels[kind] = {k: dataclasses.replace(base, lib=lib).grouped().matmul for k, lib in libs.items()}
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            for kernel, fns in kernels.items():
                best = {k: float("inf") for k in fns}
                for _ in range(repeats):
                    for k, fn in fns.items():
                        best[k] = min(best[k], best_us(lambda: fn(x), 1))
                print(json.dumps({"kind": "grouped_ab", "matrix": name, "in": in_features, "out": out, "rows": rows,
                                  "kernel": kernel, "us_a": round(best["A"], 1), "us_b": round(best["B"], 1),
                                  "b_over_a": round(best["B"] / best["A"], 2), "isa_a": isas["A"], "isa_b": isas["B"],
                                  "tier_a": library_tier(libs["A"]), "tier_b": library_tier(libs["B"]),
                                  "threads": torch.get_num_threads(),
                                  "cpu": cpu_model()}), flush=True)


def end_to_end(repeats: int, tokens: int) -> None:
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engines = {mode: LLM(gguf_weights=mode) for mode in ("packed", "dequantized")}
    best = {mode: 0.0 for mode in engines}
    for _ in range(repeats):
        for mode, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate(["The history of the printing press"], params)
            elapsed = time.perf_counter() - start
            best[mode] = max(best[mode], len(out[0].outputs[0].token_ids) / elapsed)
    print(json.dumps({"kind": "e2e", "requests": 1, "output_tokens": tokens, "repeats": repeats,
                      **{f"{mode}_tok_s": round(v, 2) for mode, v in best.items()},
                      "speedup": round(best["packed"] / best["dequantized"], 3), "threads": torch.get_num_threads(),
                      "tier": library_tier(cpu_packed.build()), "cpu": cpu_model()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--e2e", action="store_true", help="also the end-to-end single stream")
    parser.add_argument("--e2e-only", action="store_true")
    parser.add_argument("--e2e-repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--group", action="store_true", help="also the GPTQ/AWQ kernel")
    parser.add_argument("--group-only", action="store_true")
    parser.add_argument("--group-tier", default=None, help="ISA tier of the --group build (default: as served)")
    parser.add_argument("--grouped-ab", nargs="?", const="avx512", metavar="TIER",
                        help="only the interleaved-rows kernels: -march=native against this ISA tier's build "
                             "(none given: avx512, the 8-lane int16 kernel)")
    args = parser.parse_args()
    if args.grouped_ab is not None:
        grouped_ab(resolve_model(None).weights, args.rows, args.repeats, args.grouped_ab)
        return
    if args.group or args.group_only:
        group_rows(resolve_model(None).weights, args.rows, args.repeats, args.group_tier)
    if args.group_only:
        return
    if not args.e2e_only:
        kernel_rows(resolve_model(None).weights, args.rows, args.repeats)
    if args.e2e or args.e2e_only:
        end_to_end(args.e2e_repeats, args.tokens)


if __name__ == "__main__":
    main()
