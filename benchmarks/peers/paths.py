"""Where the harness keeps what setup.sh installs: outside the repo, in the user's own cache.

Peers cache (vLLM venv, llama-server build, GGUF files, logs): $PAGEDSERVE_PEERS_CACHE, else
${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-peers. Tools cache (the plot/profile venv):
$PAGEDSERVE_TOOLS_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-tools. paths.sh is the
shell twin of this file; both must agree. Functions, not constants: the environment is read when
a path is needed, never at import.
"""

from __future__ import annotations

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


def llama_server() -> Path:
    return peers_cache() / "llama-build" / "bin" / "llama-server"


def llama_server_no_amx() -> Path:
    """build_llama_server.sh --no-amx: AVX-512/VNNI/BF16 named instead of -march=native, for VMs that list AMX but
    do not grant its tile state (the native build dies there; this one keeps llama.cpp's weight repacking)."""
    return peers_cache() / "llama-build-noamx" / "bin" / "llama-server"


def gguf_dir() -> Path:
    return peers_cache() / "gguf"


def tools_python() -> Path:
    return tools_cache() / "tools-venv" / "bin" / "python"
