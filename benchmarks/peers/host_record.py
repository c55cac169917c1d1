"""What every peer result records about the host and the builds compared on it: the CPU model (lscpu's Model name),
the ISA flags that decide the tiers, the tier asked for, the tier pagedserve's kernels were built for under that
request (a subprocess with the very environment the servers get), and the host's measured read bandwidth with each
system's fraction of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import servers

# The flags that place a CPU in a tier (pagedserve's and llama.cpp's alike); amx_* as cpuid lists them, which is
# not whether the VM grants the tile state (build_llama_server.sh's probe says that, in each build's record).
TIER_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")

_ISA_PROBE = r"""
import json
out = {}
try:
    from pagedserve.kernels.cpu import isa
    forced = isa.requested_tier()
    out["tier"] = forced.name if forced else "native (host tier " + isa.host_tier() + ")"
except Exception as exc:
    out["tier"] = "unknown (%s: %s)" % (type(exc).__name__, exc)
try:
    from pagedserve.kernels.cpu import packed as cp
    lib = cp.build()
    out["packed_kernels"] = {f: getattr(cp, f)(lib) for f in ("isa", "grouped_isa", "group_isa", "group_grouped_isa")
                             if hasattr(cp, f)}
    if hasattr(cp, "grouped_isas"):  # per GGUF type: Q5_0 and the K formats have their own interleaved kernels
        out["packed_kernels"]["grouped_isa_by_type"] = cp.grouped_isas(lib)
except Exception as exc:
    out["packed_kernels"] = "unknown (%s: %s)" % (type(exc).__name__, exc)
try:  # the dense bf16 kernels: the grouped GEMV, and the GEMM's path per compute dtype ("amx" where granted)
    from pagedserve.quant.dense_layout import grouped_isa
    from pagedserve.quant.dense_native import gemm_isa
    out["dense_kernels"] = {"grouped_gemv": grouped_isa(), "gemm_bf16": gemm_isa(), "gemm_fp32": gemm_isa(True)}
except Exception as exc:
    out["dense_kernels"] = "unknown (%s: %s)" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def cpu_model() -> str:
    """lscpu's Model name (what a reader looks the CPU up by); /proc/cpuinfo's model name where lscpu is missing."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30).stdout
        for line in text.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in TIER_FLAGS if f in have]
    return []


def pagedserve_isa(tier: str, timeout: float = 900) -> dict:
    """The tier pagedserve's kernels build for in a process started with servers.pagedserve_env(tier)."""
    try:
        done = subprocess.run([sys.executable, "-P", "-c", _ISA_PROBE], env=servers.pagedserve_env(tier),
                              capture_output=True, text=True, timeout=timeout, cwd="/")
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def host(tier: str, conditions: str) -> dict:
    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0)),
            "tier": tier, "conditions": conditions, "load_avg_1m_start": os.getloadavg()[0],
            "pagedserve_isa": pagedserve_isa(tier)}


def read_bandwidth_gb_s(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """benchmarks/read_bandwidth.py's measurement (torch threads summing a buffer far larger than the caches)."""
    import torch

    from read_bandwidth import read_bandwidth

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return read_bandwidth(gib, repeats) / 1e9
    finally:
        torch.set_num_threads(before)


def bandwidth_fraction(weight_bytes: int, tok_s: float, streams: int, read_gb_s: float) -> float:
    """The share of the measured read bandwidth a system's weight reads take: a decode step reads every weight once
    for all its streams, so weight bytes x steps/s (tok/s / streams) / bandwidth; at 1 stream, bytes x tok/s / bw."""
    return weight_bytes * (tok_s / streams) / (read_gb_s * 1e9)
