"""A stand-in for the GPU image's site-packages: links to this host's copies of the image's packages, and no others.

    python3 tests/gpu/image_site.py DEST     # DEST/<top-level entries> -> this interpreter's site-packages

tests/gpu/install_check.sh points a clean venv at DEST through a .pth file, so the venv sees torch, triton,
transformers, pip, setuptools ... (at this host's versions) but not gguf, starlette, uvicorn, smg-grpc-proto,
grpcio-health-checking/reflection or pagedserve: exactly what the GPU machine lacks. Prints what it linked and
which image packages this host does not have.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

LIST = Path(__file__).with_name("image_packages.txt")


def image_packages() -> set[str]:
    lines = (line.split("#", 1)[0] for line in LIST.read_text().splitlines())
    return {canonicalize_name(name) for line in lines for name in line.split()}


def top_level_entries(dist: importlib.metadata.Distribution) -> set[Path]:
    """The site-packages entries a distribution installed (package folders, modules, its .dist-info)."""
    base = Path(dist.locate_file(""))
    entries = set()
    for f in dist.files or ():
        parts = Path(f).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth"):
            entries.add(base / parts[0])
    return {e for e in entries if e.exists()}


def build(dest: Path) -> tuple[list[str], list[str]]:
    dest.mkdir(parents=True, exist_ok=True)
    wanted = image_packages()
    linked, seen = [], set()
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name not in wanted or name in seen:
            continue
        seen.add(name)
        for entry in top_level_entries(dist):
            link = dest / entry.name
            if not link.exists():
                link.symlink_to(entry)
        linked.append(f"{name}=={dist.version}")
    return sorted(linked), sorted(wanted - seen)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    linked, absent = build(Path(sys.argv[1]))
    print(f"image site: {len(linked)} packages linked: {' '.join(linked)}")
    print(f"image site: {len(absent)} image packages not on this host: {' '.join(absent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
