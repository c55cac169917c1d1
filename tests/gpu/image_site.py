"""A stand-in for the GPU image's site-packages: links to this host's copies of the image's packages, and no others.

    python3 tests/gpu/image_site.py DEST     # DEST/<top-level entries> -> this interpreter's site-packages

tests/gpu/install_check.sh points a clean venv at DEST through a .pth file, so the venv sees torch, triton,
transformers, pip, setuptools ... (at this host's versions) but not gguf, starlette, uvicorn, smg-grpc-proto,
grpcio-health-checking/reflection or pagedserve: exactly what the GPU machine lacks. Prints what it linked and
which image packages this host does not have. This host's versions may need packages the image list lacks
(huggingface_hub 2.x needs httpx2); those are linked too, and listed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
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


def installed() -> dict[str, importlib.metadata.Distribution]:
    dists: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        dists.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist)
    return dists


def dependencies(dist: importlib.metadata.Distribution) -> set[str]:
    """What this host's version of the package requires (no extras): the image's own version may need less."""
    names = set()
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.add(canonicalize_name(req.name))
    return names


def build(dest: Path) -> tuple[list[str], list[str], list[str]]:
    """Links the image's packages present here, and the dependencies of these versions that the image list lacks."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted, dists = image_packages(), installed()
    todo, seen, added = sorted(wanted & set(dists)), set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for entry in top_level_entries(dists[name]):
            link = dest / entry.name
            if not link.exists():
                link.symlink_to(entry)
        for dep in dependencies(dists[name]) - seen:
            if dep in dists:
                todo.append(dep)
                if dep not in wanted:
                    added.append(dep)
    linked = sorted(f"{n}=={dists[n].version}" for n in seen)
    return linked, sorted(set(added)), sorted(wanted - set(dists))


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    linked, added, absent = build(Path(sys.argv[1]))
    print(f"image site: {len(linked)} packages linked: {' '.join(linked)}")
    print(f"image site: {len(added)} of them not in the image list, required by this host's versions: "
          f"{' '.join(added)}")
    print(f"image site: {len(absent)} image packages not on this host: {' '.join(absent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
