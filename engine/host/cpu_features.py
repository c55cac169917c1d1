"""What the CPU computes natively, read from the kernel's view of it (/proc/cpuinfo) when asked, never at import.

Only the question `dtype=auto` needs answered: does this CPU multiply bfloat16 natively? With AMX (Sapphire Rapids
and later) or AVX512-BF16 (Cooper Lake, AMD Zen 4 and later) torch's bf16 matmuls run several times faster than
fp32 (AMX: ~7x on one core); without them bf16 is emulated through fp32 conversions and is slower than fp32.
A forced kernel tier (PAGEDSERVE_CPU_ISA / `--cpu-isa`, kernels/cpu/isa.py) answers for the host it stands in for:
forced to AVX2, an AVX-512-BF16 host decides as a Zen 3 would, so the kernels it builds are the ones that run.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.kernels.cpu import isa

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor listed (x86: `flags`, Arm: `Features`)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16_flags(cpuinfo_path: Path = CPUINFO) -> tuple[str, ...]:
    """The native-bf16 features this CPU has, in NATIVE_BF16_FLAGS order; () when none or unreadable."""
    try:
        flags = cpu_flags(cpuinfo_path.read_text())
    except OSError:
        return ()
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags)


def tier_bf16_flags(forced: isa.Tier | None, cpuinfo_path: Path = CPUINFO) -> tuple[str, ...]:
    """The native-bf16 features of the effective kernel tier: the host's (`native_bf16_flags`) when no tier is
    forced, else those the forced tier requires (only avx512_bf16 has any)."""
    if forced is None:
        return native_bf16_flags(cpuinfo_path)
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in forced.cpu_flags)


def effective_bf16_flags() -> tuple[str, ...]:
    """`tier_bf16_flags` of the tier the kernels build for now (PAGEDSERVE_CPU_ISA, read at call time; an unknown
    or unavailable tier raises isa.IsaError, as the kernels' first build would)."""
    return tier_bf16_flags(isa.requested_tier())
