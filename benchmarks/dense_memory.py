"""Resident memory of a dense checkpoint served by the engine, against its weight bytes: one JSON line per dtype.

Each dtype runs in two fresh processes. The first builds the engine (`LLM`, a small KV cache) on the default model
as an HF folder (benchmarks/hf_folder.py), generates a few tokens and lists every module then imported. The second
imports exactly those modules and compiles the native libraries first, and only then reads its baseline: the
import overhead (torch, and transformers' configuration modules that AutoTokenizer pulls in: ~60 MiB of a
~240 MiB baseline) is the same whatever the checkpoint and is SUBTRACTED (reported as `import_anon_bytes`). It
then builds the engine, generates, and reads the growth, as the process holds it and after malloc_trim.

- `weight_bytes`: the checkpoint's values times the size of the dtype the engine holds its matrices in (what a
  checkpoint stored in that dtype holds); `auto`: the engine's choice for this host's kernel tier (a 16-bit
  checkpoint on a tier without bf16 arithmetic: 16-bit weights under fp32 compute, `weight_dtype`).
- `tensor_bytes`: the model's distinct parameter and buffer storages (a tied head counted once; RoPE tables
  included); `packed_bytes`: oneDNN packed copies the torch path keeps (0 when every weight is held once).
- `anon_growth_bytes`: anonymous pages (the process's own data) gained, after the benchmark's own malloc_trim: the
  heap's live data. The target is `(anon growth - KV cache) / weight_bytes` <= 1.15 (`anon_minus_kv_over_weights`);
  what remains beside the tensors is the tokenizer (~16 MB) and Python objects.
- `served_anon_growth_bytes`: the same read before that trim, as the process holds it (the entry trimmed the heap
  once after loading; the allocator thresholds then keep the steps' freed temporaries, so this part depends on
  the workload and on where the heap placed them; `served_anon_minus_kv_over_weights`).
- `rss_growth_bytes`: VmRSS gained, file-backed pages included: shared-library code first run while loading and
  generating (~14 MiB of libtorch_cpu), not data; `rss_minus_kv_over_weights` reports it as a ratio too.
- `peak_growth_bytes`: VmHWM gained: the checkpoint file's mapped pages while it is read (file-backed, reclaimable)
  and the load's transients (oneDNN packing, the native step's unpacking).

`--native-step-max-batch 0` measures the torch path alone (no native step). PAGEDSERVE_CPU_ISA=avx2 forces the AVX2
tier of the native kernels (kernels/cpu/isa.py); `isa_tier` records the tier built. Memory is not timing: a busy
host does not change the figures, but run it alone all the same.

    python benchmarks/dense_memory.py
    python benchmarks/dense_memory.py --dtypes bfloat16 float16 float32
    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/dense_memory.py --dtypes bfloat16
    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/dense_memory.py --dtypes auto --model ~/.cache/pagedserve-peers/models/llama-1b-shape-smollm2-vocab
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

KV_BYTES = 16 << 20
_STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def _status(trim: bool = True) -> dict[str, int]:
    """/proc/self/status's memory fields in bytes, after a collection and (trim) malloc_trim: freed heap pages
    returned, where the engine's allocator thresholds (engine/host/allocator.py) would keep them."""
    from pagedserve.engine.host.allocator import release_freed_memory

    gc.collect()
    if trim:
        release_freed_memory()
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in _STATUS_FIELDS:
            out[key] = int(line.split()[1]) * 1024
    return out


def _engine(folder: Path, dtype: str, max_batch: int | None):
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, kv_cache_memory=KV_BYTES, native_step_max_batch=max_batch)
    llm.generate([list(range(200, 232))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return llm


def modules_child(folder: Path, dtype: str, max_batch: int | None) -> dict:
    """Every module an engine imports by the end of a generation (the measuring child imports them first)."""
    _engine(folder, dtype, max_batch)
    return {"modules": sorted(name for name in sys.modules if not name.startswith("__"))}


def _import_all(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - modules made at run time (torch's generated ones) have no file to import
            pass


def _checkpoint_values(folder: Path) -> int:
    import torch
    from safetensors import safe_open

    values = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            values += sum(torch.Size(st.get_slice(key).get_shape()).numel() for key in st.keys())
    return values


def _model_bytes(runner) -> tuple[int, int, int]:
    """(distinct parameter and buffer storages, oneDNN packed copies, KV cache) of the engine's runner."""
    import torch

    model = runner.model
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    packed = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in model.modules()
                 if isinstance(getattr(m, "packed_weight", None), torch.Tensor))
    kv = sum(t.numel() * t.element_size() for layer in runner.kv_cache.layers for t in (layer.k, layer.v)
             if isinstance(t, torch.Tensor))
    return sum(storages.values()), packed, kv


def measure_child(folder: Path, dtype: str, max_batch: int | None, modules: list[str]) -> dict:
    start = _status()
    _import_all(modules)
    import torch

    from pagedserve.kernels.cpu import native, packed
    from pagedserve.kernels.cpu.build import library_tier

    lib = native.load_library()
    packed.build()  # compiled objects mapped before the baseline
    values = _checkpoint_values(folder)
    before = _status()
    llm = _engine(folder, dtype, max_batch)
    loaded = llm.engine.loaded
    held = loaded.weight_dtype or loaded.dtype  # the matrices' dtype in memory
    weight_bytes = values * held.itemsize
    served = _status(trim=False)
    after = _status()
    runner = llm.engine.runner
    tensor_bytes, packed_bytes, kv = _model_bytes(runner)
    grown = {key: after[key] - before[key] for key in _STATUS_FIELDS}
    return {"kind": "dense_memory", "dtype": dtype, "compute_dtype": str(loaded.dtype).removeprefix("torch."),
            "weight_dtype": str(held).removeprefix("torch."), "model": str(folder), "native_step": runner.native_step is not None,
            "native_step_max_batch": max_batch, "weight_bytes": weight_bytes, "tensor_bytes": tensor_bytes,
            "packed_bytes": packed_bytes, "kv_cache_bytes": kv, "import_anon_bytes": before["RssAnon"] - start["RssAnon"],
            "anon_growth_bytes": grown["RssAnon"], "rss_growth_bytes": grown["VmRSS"],
            "file_growth_bytes": grown["RssFile"], "peak_growth_bytes": grown["VmHWM"],
            "other_anon_bytes": grown["RssAnon"] - kv - tensor_bytes - packed_bytes,
            "anon_minus_kv_over_weights": round((grown["RssAnon"] - kv) / weight_bytes, 4),
            "served_anon_growth_bytes": served["RssAnon"] - before["RssAnon"],
            "served_anon_minus_kv_over_weights": round((served["RssAnon"] - before["RssAnon"] - kv) / weight_bytes, 4),
            "rss_minus_kv_over_weights": round((grown["VmRSS"] - kv) / weight_bytes, 4),
            "isa_tier": library_tier(lib), "cpu": cpu_model(), "threads": torch.get_num_threads()}


def _child(folder: Path, dtype: str, max_batch: int | None, modules: Path | None) -> list[str]:
    command = [sys.executable, "-P", __file__, "--child", dtype, "--folder", str(folder)]
    if max_batch is not None:
        command += ["--native-step-max-batch", str(max_batch)]
    if modules is not None:
        command += ["--modules", str(modules)]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="engine dtypes (auto included)")
    parser.add_argument("--model", default=None, help="an HF folder (default: the default model's)")
    parser.add_argument("--native-step-max-batch", type=int, default=None,
                        help="EngineConfig.native_step_max_batch (0: no native step, the torch path alone)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--modules", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder = Path(args.folder)
        if args.modules:
            names = json.loads(Path(args.modules).read_text())["modules"]
            print(json.dumps(measure_child(folder, args.child, args.native_step_max_batch, names)))
        else:
            print(json.dumps(modules_child(folder, args.child, args.native_step_max_batch)))
        return
    import tempfile

    from hf_folder import hf_folder

    folder = hf_folder(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            listing = Path(tmp) / f"{dtype}.json"
            listing.write_text(_child(folder, dtype, args.native_step_max_batch, None)[-1])
            print(_child(folder, dtype, args.native_step_max_batch, listing)[-1], flush=True)


if __name__ == "__main__":
    main()
