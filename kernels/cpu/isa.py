"""The CPU instruction-set tiers the native kernels are built for (kernels/cpu/isa.h is their C side), which of them
this host runs, and the one a build uses.

By default every library is compiled with -march=native and reports the tier its flags reach. PAGEDSERVE_CPU_ISA
(read when a library is first built, never at import) forces a tier instead: the library is compiled with exactly
that tier's flags on top of the x86-64 baseline, so a higher tier's code is not even compiled in, and a Zen 3's AVX2
kernels can be tested and measured on an AVX-512 host. A tier the host lacks is refused, naming those it has.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "PAGEDSERVE_CPU_ISA"
NATIVE = "native"  # the default: -march=native


class IsaError(ValueError):
    """An unknown tier name, or a tier this host's CPU lacks."""


@dataclass(frozen=True, slots=True)
class Tier:
    """name: as isa.h's PS_ISA_TIER spells it; cpu_flags: what /proc/cpuinfo must list; compile_flags: what gcc
    gets (besides the common ones) to build exactly this tier."""

    name: str
    cpu_flags: tuple[str, ...]
    compile_flags: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Tier.name: {self.name!r} is not an identifier")


_BASE = ("-march=x86-64", "-mtune=native")
_AVX2 = (*_BASE, "-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_VNNI = (*_AVX512, "-mavx512vnni", "-mavx512vbmi")
# Lowest first; a host's tier is the last one whose flags it has (not a chain: Zen 4 has avx512_bf16, not avx2_vnni).
TIERS: tuple[Tier, ...] = (
    Tier("portable", (), _BASE),
    Tier("avx2", ("avx2", "fma", "f16c"), _AVX2),
    Tier("avx2_vnni", ("avx2", "fma", "f16c", "avx_vnni"), (*_AVX2, "-mavxvnni")),
    Tier("avx512", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"), _AVX512),
    Tier("avx512_vnni", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
                         "avx512vbmi"), _AVX512_VNNI),
    Tier("avx512_bf16", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
                         "avx512vbmi", "avx512_bf16"), (*_AVX512_VNNI, "-mavx512bf16")),
)
TIER_NAMES = tuple(t.name for t in TIERS)


def tier(name: str) -> Tier:
    """The tier called `name`; raises IsaError listing the known names."""
    for t in TIERS:
        if t.name == name:
            return t
    raise IsaError(f"{ENV_VAR}: unknown CPU ISA tier {name!r}; known: {', '.join((NATIVE, *TIER_NAMES))}")


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def available_tiers(cpu_flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The tiers this host (or a CPU listing `cpu_flags`) runs, lowest first; "portable" only off x86-64."""
    if cpu_flags is None:
        if not _x86():
            return ("portable",)
        cpu_flags = _cpu_flags()
    return tuple(t.name for t in TIERS if cpu_flags.issuperset(t.cpu_flags))


def host_tier(cpu_flags: frozenset[str] | None = None) -> str:
    """The highest tier this host runs."""
    return available_tiers(cpu_flags)[-1]


def check_available(name: str, cpu_flags: frozenset[str] | None = None) -> Tier:
    """The tier `name`, refused (IsaError naming the host's tiers) when this host lacks it."""
    wanted = tier(name)
    have = available_tiers(cpu_flags)
    if name not in have:
        raise IsaError(f"{ENV_VAR}: this CPU has no {name!r} tier (needs {', '.join(wanted.cpu_flags)}); "
                       f"available here: {', '.join(have)}")
    return wanted


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def compile_flags(forced: Tier | None) -> tuple[str, ...]:
    """gcc's ISA flags for a build: -march=native unless a tier is forced (off x86-64 only "portable" exists, and
    it is the compiler's default target)."""
    if forced is None:
        return ("-march=native",)
    return forced.compile_flags if _x86() else ()


def requested_tier() -> Tier | None:
    """The tier PAGEDSERVE_CPU_ISA forces, checked against this host; None when unset or "native" (-march=native).
    Read at call time: the kernels' loaders call it when they first build."""
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if name in ("", NATIVE):
        return None
    return check_available(name)
