"""The carried wheel list (tests/gpu/wheels.txt): parsed, checked against pyproject.toml's pins, matched to files.

    python3 tests/gpu/wheels.py check [WHEEL_DIR]   # prints the wheel files to install, one a line; exit 1 if wrong

device_check.sh installs exactly the files this prints; tests/test_device_check.py runs the same checks.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
WHEELS_TXT = Path(__file__).with_name("wheels.txt")
# The project's dependencies the GPU machine's image already holds (KINDS.md's package list), at versions the
# project accepts (transformers 5.17 there): never carried, and never replaced (torch above all).
PREINSTALLED = frozenset({"torch", "transformers", "tokenizers", "safetensors", "accelerate", "numpy", "tqdm", "jinja2",
                          "pyyaml", "huggingface-hub"})
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+-]*)$")


class WheelListError(ValueError):
    """wheels.txt disagrees with pyproject.toml or with the wheel folder; the message names the line or file."""


@dataclass(frozen=True, slots=True)
class Pin:
    name: str  # canonical (PEP 503) name
    version: str


def read_pins(path: Path = WHEELS_TXT) -> list[Pin]:
    pins = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if match is None:
            raise WheelListError(f"{path.name}:{number}: {line!r} is not a pinned name==version")
        pins.append(Pin(canonicalize_name(match[1]), match[2]))
    names = [p.name for p in pins]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise WheelListError(f"{path.name}: a package is named twice ({twice})")
    return pins


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Requirement]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


def check_against_pyproject(pins: list[Pin], requirements: dict[str, Requirement]) -> None:
    """Every pin satisfies the project's own requirement; every dependency is carried or preinstalled."""
    for pin in pins:
        req = requirements.get(pin.name)
        if req is not None and not req.specifier.contains(pin.version, prereleases=True):
            raise WheelListError(f"wheels.txt: {pin.name}=={pin.version} does not satisfy pyproject's {req}")
    carried = {p.name for p in pins}
    uncovered = sorted(set(requirements) - carried - PREINSTALLED)
    if uncovered:
        raise WheelListError(f"pyproject dependencies neither carried in wheels.txt nor preinstalled: {uncovered}")
    replaced = sorted(carried & PREINSTALLED)
    if replaced:
        raise WheelListError(f"wheels.txt replaces the GPU image's own {replaced}")


def wheel_files(pins: list[Pin], folder: Path) -> list[Path]:
    """The one wheel of each pin in `folder`; a missing, extra or second version of a package is an error."""
    found: dict[str, list[tuple[str, Path]]] = {}
    for f in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(f.name)
        found.setdefault(canonicalize_name(name), []).append((str(version), f))
    chosen = []
    for pin in pins:
        matches = [f for v, f in found.pop(pin.name, []) if v == pin.version]
        if len(matches) != 1:
            raise WheelListError(f"{folder}: expected one wheel of {pin.name}=={pin.version}, found "
                                 f"{[m.name for m in matches] or 'none'} (run tests/gpu/fetch_wheels.sh)")
        chosen.append(matches[0])
    if found:
        extra = sorted(f.name for versions in found.values() for _, f in versions)
        raise WheelListError(f"{folder}: wheels not in wheels.txt: {extra}")
    return chosen


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] != "check":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        pins = read_pins()
        check_against_pyproject(pins, project_requirements())
        files = wheel_files(pins, Path(argv[1])) if len(argv) == 2 else []
    except WheelListError as exc:
        print(f"wheels: {exc}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
