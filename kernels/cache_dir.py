"""pagedserve's on-disk cache folder (converted models, compiled native kernels), shared by every package."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache folder, read at call time (never at import) so tests can redirect it."""
    explicit = os.environ.get("PAGEDSERVE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pagedserve"
