#!/usr/bin/env bash
# Downloads the wheels named in tests/gpu/wheels.txt for the GPU machine (CPython 3.12, manylinux x86_64) into
# .whl/ at the repository root (git-ignored), to be carried by the device call (docs/gpu.md). Needs PyPI.
#   bash tests/gpu/fetch_wheels.sh [DEST] [PYTHON_VERSION]   # defaults: .whl 3.12
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$root/.whl}"
pyver="${2:-3.12}"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" -r "$root/tests/gpu/wheels.txt"
ls -l "$dest"
