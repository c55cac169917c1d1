"""Resident memory of a GGUF model's weights, packed (the file's blocks) vs dequantized at load: one JSON line.

Each mode loads the model in a fresh process and reads its resident set (VmRSS) before and after `load_model`
(after the imports, the kernel build and one throwaway read of the file's metadata, which imports transformers:
only the weights and the load's leftovers count). The bf16 bytes are
the file's value count times two (a tied head is not in the file). `*_trimmed` is the same after malloc_trim, which
hands the heap's free pages back (what the load freed but the heap kept); `*_anon*` counts anonymous pages only
(heap and tensors: the file-backed code pages that imports during the load map are left out); `*_tensor_bytes` is
what the model's parameters and buffers (RoPE tables included) hold.

    python benchmarks/packed_memory.py                 # the default SmolLM2-135M Q4_1 file
    python benchmarks/packed_memory.py --model gemma-3-270m
    PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/packed_memory.py --model FILE.gguf --dtype auto --modes auto auto-dense-copy

Modes: `packed`, `dequantized`, `auto` (`--gguf-weights` as named), and `auto-dense-copy`: `auto` with the dense copy
kept whatever the packed build (quant/gguf.py's many-row rule switched off): what `auto` held before that rule.
`--dtype auto` loads as `--dtype auto` does (fp32 compute on a tier without bf16 arithmetic).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import subprocess
import sys
from pathlib import Path


MODES = ("packed", "dequantized", "auto", "auto-dense-copy")


def _rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(model: str | None, mode: str, dtype: str) -> dict:
    import torch

    from pagedserve.quant import gguf as gguf_method

    from pagedserve.engine.loading.gguf_checkpoint import GgufCheckpoint
    from pagedserve.engine.loading.model_loader import load_model
    from pagedserve.engine.loading.model_store import resolve_model
    from pagedserve.kernels.cpu import packed as cpu_packed

    cpu_packed.build()
    path = resolve_model(model).weights
    GgufCheckpoint(path)  # imports transformers and the gguf reader once: the baseline holds what they keep
    gc.collect()
    before, before_anon = _rss_bytes(), _rss_bytes("RssAnon")
    if mode == "auto-dense-copy":
        gguf_method.MANY_ROW_GROUPED_ISAS = ()
    loaded = load_model(path, None if dtype == "auto" else getattr(torch, dtype), None, torch.device("cpu"),
                        mode.removesuffix("-dense-copy"))
    gc.collect()
    after = _rss_bytes()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)  # the heap's free pages back to the system
    trimmed, trimmed_anon = _rss_bytes(), _rss_bytes("RssAnon")
    from gguf import GGUFReader

    values = sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    copies = sum(m.__dict__.get("dense_copy") is not None for m in loaded.model.modules())
    return {"mode": mode, "dense_copies": copies, "quantization": loaded.quant.describe(), "weights_rss_bytes": after - before,
            "weights_rss_bytes_trimmed": trimmed - before, "weights_rss_anon_bytes_trimmed": trimmed_anon - before_anon,
            "bf16_bytes": 2 * values,
            "tensor_bytes": sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model as --model takes it (default: the embedded SmolLM2)")
    parser.add_argument("--modes", nargs="+", default=["packed", "dequantized"], choices=MODES)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.dtype)))
        return
    rows = {}
    for mode in args.modes:
        command = [sys.executable, __file__, "--child", mode, "--dtype", args.dtype] + (
            ["--model", args.model] if args.model else [])
        rows[mode] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    bf16 = next(iter(rows.values()))["bf16_bytes"]
    print(json.dumps({
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF)", "bf16_bytes": bf16, "dtype": args.dtype,
        **{f"{mode}_dense_copies": row["dense_copies"] for mode, row in rows.items()},  # layers holding one
        **{f"{mode}_weights_rss_bytes": row["weights_rss_bytes"] for mode, row in rows.items()},
        **{f"{mode}_weights_rss_bytes_trimmed": row["weights_rss_bytes_trimmed"] for mode, row in rows.items()},
        **{f"{mode}_weights_rss_anon_bytes_trimmed": row["weights_rss_anon_bytes_trimmed"] for mode, row in rows.items()},
        **{f"{mode}_anon_trimmed_fraction_of_bf16": round(row["weights_rss_anon_bytes_trimmed"] / bf16, 4)
           for mode, row in rows.items()},
        **{f"{mode}_tensor_bytes": row["tensor_bytes"] for mode, row in rows.items()},
        **{f"{mode}_fraction_of_bf16": round(row["weights_rss_bytes"] / bf16, 4) for mode, row in rows.items()},
        **{f"{mode}_trimmed_fraction_of_bf16": round(row["weights_rss_bytes_trimmed"] / bf16, 4)
           for mode, row in rows.items()},
        **{f"{mode}_quantization": row["quantization"] for mode, row in rows.items()},
    }))


if __name__ == "__main__":
    main()
