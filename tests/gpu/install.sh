#!/usr/bin/env bash
# Installs pagedserve from this working tree into SITE without touching the interpreter's own packages: the carried
# wheels (tests/gpu/wheels.txt, from WHEEL_DIR) first, then the project itself with --no-deps, so its CPU torch
# pin never resolves and the machine's torch and triton are used. Nothing is fetched (--no-index).
#   bash tests/gpu/install.sh SITE WHEEL_DIR [--skip-wheels]
# Then: PYTHONPATH=SITE, PATH=SITE/bin:$PATH. PYTHON picks the interpreter (default python3).
# --skip-wheels (the dry run on a host whose Python differs from the GPU machine's 3.12): the wheel list is still
# checked against pyproject.toml, and against WHEEL_DIR when that folder exists, but nothing from it is installed.
set -euo pipefail
site="$1"; wheels="$2"; skip_wheels="${3:-}"
py="${PYTHON:-python3}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
pip=("$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check
     --root-user-action=ignore)
mkdir -p "$site"
"$py" --version
if [ -d "$wheels" ]; then
  mapfile -t files < <("$py" "$root/tests/gpu/wheels.py" check "$wheels")
  [ "${#files[@]}" -gt 0 ] || { echo "install: no wheels listed" >&2; exit 1; }
  if [ "$skip_wheels" = "--skip-wheels" ]; then
    echo "install: ${#files[@]} wheels checked in $wheels, not installed (--skip-wheels)"
  else
    "${pip[@]}" --upgrade --target "$site" "${files[@]}"
    echo "install: ${#files[@]} wheels into $site"
  fi
else
  if [ "$skip_wheels" != "--skip-wheels" ]; then
    echo "install: $wheels is missing: run tests/gpu/fetch_wheels.sh" >&2
    exit 1
  fi
  "$py" "$root/tests/gpu/wheels.py" check
  echo "install: wheel list checked against pyproject.toml; no wheel folder at $wheels"
fi
# Build from a copy of the package folders: an in-tree build would leave build/ and *.egg-info in the checkout.
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
(cd "$root" && cp -r --parents pyproject.toml README.md engine kernels quant service proto/pagedserve \
   clients/python/pagedserve_client "$src/")
find "$src" -name __pycache__ -prune -exec rm -rf {} +
"${pip[@]}" --no-build-isolation --upgrade --target "$site" "$src"
echo "install: pagedserve into $site"
PYTHONPATH="$site" "$py" - "$site" <<'PY'
import importlib, pathlib, sys
site = pathlib.Path(sys.argv[1]).resolve()
modules = ["pagedserve.engine.llm", "pagedserve.kernels.backends", "pagedserve.quant.registry",
           "pagedserve.service.entry", "pagedserve.service.server", "pagedserve.service.router.vllm_servicer",
           "pagedserve.v1.generate_pb2_grpc", "grpc_health.v1.health_pb2_grpc", "grpc_reflection.v1alpha.reflection",
           "smg_grpc_proto.generated.vllm_engine_pb2", "starlette", "uvicorn", "gguf", "prometheus_client"]
for name in modules:
    importlib.import_module(name)
import pagedserve.engine
where = pathlib.Path(pagedserve.engine.__file__).resolve()
assert site in where.parents, f"pagedserve imported from {where}, not from {site}"
script = site / "bin" / "pagedserve"
assert script.is_file(), f"the console script {script} was not installed"
print(f"install: {len(modules)} modules import; pagedserve from {where.parent.parent}; console script {script}")
PY
PYTHONPATH="$site" "$site/bin/pagedserve" serve --help >/dev/null
echo "install: $site/bin/pagedserve serve --help runs"
