"""The CPU ISA tiers a kernel test runs in (kernels/cpu/isa.py): "native" (-march=native, what serves by default)
and each forced tier, skipped where this host lacks it, so every test lists the same cases on any CPU."""

from __future__ import annotations

import pytest

from pagedserve.kernels.cpu import isa

# The tiers every CPU kernel test covers: the default build, AVX2 (the Zen 3 class of host) and portable C.
CORE = ("native", "avx2", "portable")
# Every tier: for the kernels whose code differs per tier (the packed and group kernels).
ALL = ("native", *isa.TIER_NAMES)


def params(names: tuple[str, ...]) -> list:
    have = isa.available_tiers()
    return [pytest.param(n, id=n, marks=pytest.mark.skipif(n != "native" and n not in have,
                                                            reason=f"this CPU has no {n} tier")) for n in names]
