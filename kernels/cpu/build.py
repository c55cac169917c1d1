"""Compiles the native CPU libraries once per machine and tier, caches them on disk, and loads them through ctypes.

Why ctypes and gcc rather than a torch C++ extension: the C files include no torch headers, so they compile in a few
seconds, and the build needs only a C compiler. Each library links the OpenMP runtime torch already loaded (same
soname), so its parallel regions share torch's thread pool instead of starting a second one.
An object is cached by a hash of its sources, every header, the flags, the compiler and the CPU, so a changed file
or another machine never runs a stale one. At load every C structure a ctypes class mirrors is checked against the
C `sizeof` (`ps_sizeof_<name>`, isa.h's PS_SIZEOF), so a field added on one side only fails loudly, naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import concurrent.futures
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedserve.kernels.cache_dir import cache_root
from pagedserve.kernels.cpu import isa

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMMON_FLAGS = (
    "-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=fast", "-fno-math-errno",
    "-fno-trapping-math",
)


class NativeBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded here (no C compiler, an unsupported CPU, ...)."""


class StructLayoutError(NativeBuildError):
    """A ctypes structure's size differs from its C struct's: one side changed without the other."""

    def __init__(self, struct: str, c_size: int, py_size: int, mirror: str) -> None:
        super().__init__(f"C struct {struct!r} is {c_size} bytes but its ctypes mirror {mirror} is {py_size}: "
                         "update both sides together")
        self.struct = struct


Structs = tuple[tuple[str, type[ctypes.Structure]], ...]


@dataclass(frozen=True, slots=True)
class LibrarySpec:
    """One shared object: its C files (in kernels/cpu/; isa.c is always linked in), the structures to check at load
    (C name as in `ps_sizeof_<name>`, ctypes class) and the function that declares its signatures."""

    name: str
    sources: tuple[str, ...]
    structs: Structs
    declare: Callable[[ctypes.CDLL], None]

    def __post_init__(self) -> None:
        missing = [s for s in self.sources if not (HERE / s).is_file()]
        if missing:
            raise ValueError(f"LibrarySpec {self.name}: no such C file in kernels/cpu/: {', '.join(missing)}")


def cpu_fingerprint() -> str:
    """What a cached object's name must include: -march=native / -mtune=native code is for this CPU model only."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_struct_sizes(lib: ctypes.CDLL, structs: Structs) -> None:
    """Raises StructLayoutError for the first structure whose ctypes size differs from the C one."""
    for name, mirror in structs:
        size_fn = getattr(lib, f"ps_sizeof_{name}")
        size_fn.restype = ctypes.c_size_t
        if size_fn() != ctypes.sizeof(mirror):
            raise StructLayoutError(name, size_fn(), ctypes.sizeof(mirror), mirror.__name__)


def library_tier(lib: ctypes.CDLL) -> str:
    """The ISA tier `lib` was compiled for (isa.h's PS_ISA_TIER)."""
    lib.pagedserve_isa_tier.restype = ctypes.c_char_p
    return lib.pagedserve_isa_tier().decode()


def _compiler() -> str:
    if platform.system() != "Linux":
        raise NativeBuildError(f"native CPU kernels are built for Linux only, not {platform.system()}")
    compiler = shutil.which(os.environ.get("CC") or "gcc") or shutil.which("cc")
    if compiler is None:
        raise NativeBuildError("no C compiler found (set CC or install gcc)")
    return compiler


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeBuildError(f"{command[0]} failed on {what}: {result.stderr.strip()[-2000:]}")


def _compile(compiler: str, flags: tuple[str, ...], sources: tuple[Path, ...], target: Path) -> None:
    """One object per source, compiled side by side on the host's cores, then linked: a cold cache (CI, a new
    host) builds each library in the time of its largest source rather than the sum of all of them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        workers = max(1, min(len(sources), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            jobs = [pool.submit(_run, [compiler, *flags, "-c", str(source), "-o", str(obj)], source.name)
                    for source, obj in zip(sources, objects)]
            for job in jobs:
                job.result()
        staging = Path(tmp) / target.name
        _run([compiler, *flags, *map(str, objects), "-o", str(staging), "-lm"], target.name)
        os.replace(staging, target)  # atomic: concurrent builders never load a half-written object


@contextlib.contextmanager
def _build_lock(target: Path):
    """Held while `target` is built: processes that need the same uncached library at once (pytest-xdist workers,
    replicas starting on one host) wait for the first build instead of each compiling it again on shared cores."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies mid-build
        yield


def _resolve(tier: str | None) -> isa.Tier | None:
    """None: what PAGEDSERVE_CPU_ISA asks (-march=native when unset); "native"; or a tier name, checked."""
    if tier is None:
        return isa.requested_tier()
    return None if tier == isa.NATIVE else isa.check_available(tier)


@functools.cache
def load(spec: LibrarySpec, tier: str | None = None) -> ctypes.CDLL:
    """`spec`'s library for `tier` (None: PAGEDSERVE_CPU_ISA's, read now, or -march=native; "native"; or a tier
    name), built on first use and cached on disk. Raises NativeBuildError (isa.IsaError for a bad tier)."""
    forced = _resolve(tier)
    compiler = _compiler()
    flags = (*COMMON_FLAGS, *isa.compile_flags(forced))
    sources = tuple(HERE / s for s in ("isa.c", *spec.sources))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [f.read_text() for f in (*sources, *sorted(HERE.glob("*.h")))]
    key = hashlib.sha256("\0".join((*texts, " ".join(flags), version, cpu_fingerprint())).encode()).hexdigest()[:16]
    label = forced.name if forced else isa.NATIVE
    target = cache_root() / "native" / f"cpu_{spec.name}-{label}-{key}.so"
    if not target.exists():
        with _build_lock(target):
            if not target.exists():  # another process may have built it while this one waited
                _compile(compiler, flags, sources, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target}: {exc}") from exc
    check_struct_sizes(lib, spec.structs)
    spec.declare(lib)
    how = f"forced by {isa.ENV_VAR}" if forced and tier is None else ("forced" if forced else "-march=native")
    logger.info("CPU kernels %s: ISA tier %s (%s), %s", spec.name, library_tier(lib), how, target.name)
    return lib
