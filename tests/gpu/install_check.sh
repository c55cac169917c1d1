#!/usr/bin/env bash
# The device check's install step in clean virtual environments standing in for the GPU machine (docs/gpu.md).
# Needs PyPI (for the cp311 wheels) and about 2 minutes; not part of the test suite.
#   bash tests/gpu/install_check.sh [OUT_DIR]
# 1. Python 3.12, as on the GPU machine: a bare venv; the carried cp312 wheels (.whl/, from fetch_wheels.sh) and
#    pagedserve install with --no-index --no-deps, and the version-sensitive modules import: grpc and protobuf under
#    the committed stubs' version checks, health, reflection, smg-grpc-proto, prometheus_client. PyPI's torch for
#    3.12 is the multi-GB CUDA build, so this venv has no torch and imports no torch-using module; it gets only
#    setuptools and typing_extensions (image packages) from PyPI.
# 2. This host's Python 3.11 with its torch: a venv without system site-packages that sees only the GPU image's
#    packages (image_site.py, through a .pth), then device_check.sh --dry-run installs the cp311 builds of the same
#    wheels and the project there and runs every dry-run stage: the project's pins (torch==2.13.0, ...) are
#    never resolved, and anything missing from wheels.txt fails the imports.
set -euo pipefail
# One function, parsed whole before it runs (editing this file mid-run is then harmless).
main() {
  root="$(cd "$(dirname "$0")/../.." && pwd)"
  out="${1:-$(mktemp -d)}"
  mkdir -p "$out"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # the first candidate that runs (a pyenv shim exists for versions it does not activate)
  pick() {
    for c in "$@"; do "$c" -c "" 2>/dev/null && { echo "$c"; return; }; done
    echo "no Python among: $*" >&2
    exit 1
  }
  pyenv_root="$(pyenv root 2>/dev/null || echo /nonexistent)"
  py312="$(pick ${PYTHON312:-} python3.12 "$pyenv_root"/versions/3.12*/bin/python3.12)"
  py311="$(pick ${PYTHON311:-} python3.11 "$pyenv_root"/versions/3.11*/bin/python3.11)"
  unset PYTHONPATH

  echo "== 1. $("$py312" --version) bare venv, cp312 wheels from $root/.whl"
  "$py312" -m venv "$tmp/v312"
  # The two image packages this step needs (grpc imports typing_extensions; the build needs setuptools), from PyPI at
  # this host's versions.
  "$tmp/v312/bin/python" -m pip install -q --disable-pip-version-check \
    $(python3 -c 'import importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in ("setuptools",
      "typing_extensions")))')
  mapfile -t files < <(python3 "$root/tests/gpu/wheels.py" check "$root/.whl")
  "$tmp/v312/bin/python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$tmp/site312" \
    "${files[@]}"
  src="$tmp/src"; mkdir -p "$src"
  (cd "$root" && cp -r --parents pyproject.toml README.md engine kernels quant service proto/pagedserve \
     clients/python/pagedserve_client "$src/")
  "$tmp/v312/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --upgrade \
    --target "$tmp/site312" "$src"
  PYTHONPATH="$tmp/site312" "$tmp/v312/bin/python" - <<'PY'
import importlib
import grpc, google.protobuf
names = ["pagedserve.v1.generate_pb2", "pagedserve.v1.generation_service_pb2_grpc", "grpc_health.v1.health_pb2_grpc",
         "grpc_reflection.v1alpha.reflection", "smg_grpc_proto.generated.vllm_engine_pb2", "prometheus_client"]
for name in names:
    importlib.import_module(name)
print(f"   grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}: {len(names)} modules import")
PY

  echo "== 2. $("$py311" --version) venv seeing only the GPU image's packages, cp311 wheels, dry-run stages"
  "$py311" -m venv --without-pip "$tmp/v311"
  "$py311" "$root/tests/gpu/image_site.py" "$tmp/image" | cut -c1-300
  purelib="$("$tmp/v311/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$tmp/image" > "$purelib/gpu_image.pth"
  bash "$root/tests/gpu/fetch_wheels.sh" "$tmp/wheels311" 3.11 > /dev/null
  PYTHON="$tmp/v311/bin/python" WHEEL_DIR="$tmp/wheels311" DEVICE_CHECK_INSTALL_WHEELS=1 \
    bash "$root/tests/gpu/device_check.sh" --dry-run "$out"
  echo "install check passed; report: $out/report.json"
}

main "$@"
