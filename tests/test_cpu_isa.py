"""The CPU ISA layer (kernels/cpu/isa.py, isa.h, build.py): tier detection from the CPU's flags, PAGEDSERVE_CPU_ISA
forcing a tier (refused, naming the host's tiers, when the CPU lacks it), each forced build compiled for exactly its
tier, the ctypes mirrors checked against the C structures' sizes at load, and a library that several processes
need at once compiled by one of them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from cpu_tiers import CORE, params
from pagedserve.kernels.cpu import isa, native, packed
from pagedserve.kernels.cpu.build import StructLayoutError, check_struct_sizes, library_tier
from pagedserve.kernels.cpu.structs import NATIVE_STRUCTS, PACKED_STRUCTS

ZEN3 = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512dq avx512vl avx512_vnni avx512vbmi avx512_bf16".split())
SAPPHIRE_RAPIDS = ZEN4 | frozenset({"avx_vnni", "amx_tile"})
CASCADE_LAKE = ZEN3 | frozenset("avx512f avx512bw avx512dq avx512vl avx512_vnni".split())


@pytest.mark.parametrize("flags,tiers", [
    (frozenset({"sse2"}), ("portable",)),
    (ZEN3, ("portable", "avx2")),
    (ZEN4, ("portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16")),  # no AVX-VNNI on Zen 4
    (SAPPHIRE_RAPIDS, isa.TIER_NAMES),
    (CASCADE_LAKE, ("portable", "avx2", "avx512")),  # VNNI without VBMI: the int16 grouped kernels need both
])
def test_tiers_are_read_from_the_cpu_flags(flags, tiers):
    assert isa.available_tiers(flags) == tiers
    assert isa.host_tier(flags) == tiers[-1]


def test_a_tier_the_cpu_lacks_or_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(isa.IsaError, match=r"no 'avx512'.*available here: portable, avx2$"):
        isa.check_available("avx512", ZEN3)
    with pytest.raises(isa.IsaError, match=r"unknown CPU ISA tier 'avx3'; known: native, portable, avx2, avx2_vnni"):
        isa.check_available("avx3", ZEN3)


def test_the_environment_is_read_when_asked(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.requested_tier() is None
    monkeypatch.setenv(isa.ENV_VAR, "native")
    assert isa.requested_tier() is None
    monkeypatch.setenv(isa.ENV_VAR, " Portable ")
    assert isa.requested_tier().name == "portable"
    monkeypatch.setenv(isa.ENV_VAR, "avx9")
    with pytest.raises(isa.IsaError, match="PAGEDSERVE_CPU_ISA: unknown"):
        isa.requested_tier()


@pytest.mark.parametrize("tier", params(CORE))
def test_each_build_is_compiled_for_its_tier(tier):
    for lib in (native.load_library(tier), packed.build(tier)):
        assert library_tier(lib) == (isa.host_tier() if tier == "native" else tier)


def test_forced_tier_without_avx512_flags_compiles_no_avx512_code():
    flags = isa.tier("avx2").compile_flags
    assert not any("avx512" in f for f in flags) and {"-mavx2", "-mfma", "-mf16c"} <= set(flags)
    assert "-march=native" not in flags


def test_every_mirrored_structure_is_checked_and_a_mismatch_names_it():
    check_struct_sizes(native.load_library(), NATIVE_STRUCTS)
    check_struct_sizes(packed.build(), PACKED_STRUCTS)
    assert len(NATIVE_STRUCTS) + len(PACKED_STRUCTS) == 6  # with engine/runner/native_step.py's three: all nine

    class Shorter(ctypes.Structure):
        _fields_ = [("format", ctypes.c_int32)]

    size = ctypes.sizeof(PACKED_STRUCTS[0][1])
    with pytest.raises(StructLayoutError, match=f"C struct 'packed_state' is {size} bytes but its ctypes mirror Shorter"):
        check_struct_sizes(packed.build(), (("packed_state", Shorter),))


@pytest.mark.skipif("avx2" not in isa.available_tiers(), reason="this CPU has no avx2 tier")
def test_the_environment_variable_forces_the_tier_of_every_library():
    """A fresh process, as a server started with PAGEDSERVE_CPU_ISA=avx2: both libraries load the AVX2 build, and
    a tier this host lacks stops the first kernel build with the error naming the available ones."""
    code = ("from pagedserve.kernels.cpu import native, packed\nfrom pagedserve.kernels.cpu.build import library_tier\n"
            "print(library_tier(native.load_library()), library_tier(packed.build()), packed.isa(packed.build()),\n"
            "      *packed.grouped_isas(packed.build()).values())")
    env = {**os.environ, isa.ENV_VAR: "avx2"}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2"] * (3 + len(packed.FORMATS))  # every GGUF type's interleaved kernel too
    missing = next((t for t in isa.TIER_NAMES if t not in isa.available_tiers()), None)
    if missing:
        env[isa.ENV_VAR] = missing
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode != 0 and "available here: portable" in out.stderr


def test_processes_that_need_the_same_uncached_library_at_once_compile_it_once(tmp_path):
    """Two fresh processes (two xdist workers, two replicas on one host) loading one library into an empty cache:
    the second waits for the first's build and loads it. The compiler is gcc behind a wrapper that logs each source
    it compiles and takes 2 s over it, so the two builds would overlap without the lock."""
    log, wrapper = tmp_path / "compiles.log", tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "$*" >> "{log}"; sleep 2;; esac\nexec gcc "$@"\n')
    wrapper.chmod(0o755)
    code = ("from pagedserve.kernels.cpu.build import LibrarySpec, library_tier, load\n"
            "print(library_tier(load(LibrarySpec('lock_probe', (), (), lambda lib: None), 'portable')))")
    env = {**os.environ, "CC": str(wrapper), "PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    builders = [subprocess.Popen([sys.executable, "-P", "-c", code], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [b.communicate(timeout=120) for b in builders]
    assert [b.returncode for b in builders] == [0, 0], [err for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["portable"], ["portable"]]
    assert len(log.read_text().splitlines()) == 1  # isa.c, the probe's one source, compiled by one of them
