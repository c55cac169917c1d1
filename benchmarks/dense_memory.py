"""Resident memory of a 16-bit dense checkpoint served with the native decode step, against its weight bytes: one
JSON line per dtype.

Each dtype runs in a fresh process: the engine (`LLM`, the native step built, a small KV cache) is created on the
default model as an HF folder (benchmarks/hf_folder.py), a few tokens are generated, and the resident set (VmRSS,
and anonymous pages RssAnon, after malloc_trim) is read before and after. `weight_bytes` is the checkpoint's
values times the dtype's size (what a checkpoint stored in that dtype holds); `tensor_bytes` what the model's distinct parameter and buffer storages hold
(a tied head counted once); `kv_cache_bytes` the cache the engine allocated. The target: anon growth minus the KV
cache <= 1.15x the weight bytes (one copy of the weights: tests/test_dense_single_copy.py checks it by storage).

    python benchmarks/dense_memory.py
    python benchmarks/dense_memory.py --dtypes bfloat16 float32
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

KV_BYTES = 16 << 20


def _rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def child(folder: Path, dtype: str) -> dict:
    import torch
    from safetensors import safe_open

    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.kernels.cpu import native, packed

    native.load_library(), packed.build()  # compiled objects mapped before the baseline
    values = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            values += sum(int(torch.Size(st.get_slice(key).get_shape()).numel()) for key in st.keys())
    weight_bytes = values * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    _trim()
    before, before_anon = _rss_bytes(), _rss_bytes("RssAnon")
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory=KV_BYTES)
    llm.generate([list(range(200, 232))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    _trim()
    after, after_anon = _rss_bytes(), _rss_bytes("RssAnon")
    runner = llm.engine.runner
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*runner.model.parameters(), *runner.model.buffers())}
    kv = sum(t.numel() * t.element_size() for layer in runner.kv_cache.layers for t in (layer.k, layer.v)
             if isinstance(t, torch.Tensor))
    grown = after_anon - before_anon - kv
    return {"kind": "dense_memory", "dtype": dtype, "native_step": runner.native_step is not None,
            "weight_bytes": weight_bytes, "tensor_bytes": sum(storages.values()), "kv_cache_bytes": kv,
            "rss_growth_bytes": after - before, "anon_growth_bytes": after_anon - before_anon,
            "anon_growth_minus_kv_over_weights": round(grown / weight_bytes, 4), "cpu": cpu_model(),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.folder), args.child)))
        return
    from hf_folder import hf_folder

    folder = hf_folder(None)
    for dtype in args.dtypes:
        command = [sys.executable, "-P", __file__, "--child", dtype, "--folder", str(folder)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
