"""Where the harness keeps what setup.sh installs: outside the repo, in the user's own cache.

Peers cache (vLLM venv, llama-server build, GGUF files, logs): $PAGEDSERVE_PEERS_CACHE, else
${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-peers. Tools cache (the plot/profile venv):
$PAGEDSERVE_TOOLS_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-tools. paths.sh is the
shell twin of this file; both must agree. Functions, not constants: the environment is read when
a path is needed, never at import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else Path.home() / ".cache"


def peers_cache() -> Path:
    env = os.environ.get("PAGEDSERVE_PEERS_CACHE")
    return Path(env) if env else _cache_home() / "pagedserve-peers"


def tools_cache() -> Path:
    env = os.environ.get("PAGEDSERVE_TOOLS_CACHE")
    return Path(env) if env else _cache_home() / "pagedserve-tools"


def vllm_python() -> Path:
    return peers_cache() / "vllm-venv" / "bin" / "python"


LLAMA_TIERS = ("native", "avx2")  # build_llama_server.sh's builds, side by side in the peers cache


def llama_build(tier: str = "native") -> Path:
    """build_llama_server.sh TIER's build folder: native (-march=native, without AMX where the VM refuses its tile
    state) or avx2 (AVX2 + FMA + F16C, no AVX-512)."""
    if tier not in LLAMA_TIERS:
        raise ValueError(f"unknown llama.cpp build tier {tier!r}; supported: {', '.join(LLAMA_TIERS)}")
    return peers_cache() / f"llama-build-{tier}"


def llama_server(tier: str = "native") -> Path:
    return llama_build(tier) / "bin" / "llama-server"


def llama_quantize(tier: str = "native") -> Path:
    return llama_build(tier) / "bin" / "llama-quantize"


def llama_build_info(tier: str = "native") -> dict:
    """What build_llama_server.sh recorded about the build (tier, cmake ISA flags, AMX probe, compiler)."""
    info = llama_build(tier) / "pagedserve-build.json"
    return json.loads(info.read_text()) if info.is_file() else {"missing": str(info)}


def gguf_dir() -> Path:
    return peers_cache() / "gguf"


def tools_python() -> Path:
    return tools_cache() / "tools-venv" / "bin" / "python"
