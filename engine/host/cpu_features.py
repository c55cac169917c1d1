"""What the CPU computes natively, read from the kernel's view of it (/proc/cpuinfo) when asked, never at import.

Only the question `dtype=auto` needs answered: does this CPU multiply bfloat16 natively? With AMX (Sapphire Rapids
and later) or AVX512-BF16 (Cooper Lake, AMD Zen 4 and later) torch's bf16 matmuls run several times faster than
fp32 (AMX: ~7x on one core); without them bf16 is emulated through fp32 conversions and is slower than fp32.
"""

from __future__ import annotations

from pathlib import Path

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
