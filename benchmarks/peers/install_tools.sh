#!/usr/bin/env bash
# The harness's own tools venv (never in CI): matplotlib for the plot, py-spy for profiles and
# the GGUF converter's sentencepiece, pinned, so nothing is installed into the user's environment.
# The converter also needs torch/transformers/numpy: a .pth file appends the project environment's
# site-packages ($PYTHON, default python3) after the venv's own, so the pinned packages win.
set -euo pipefail
. "$(dirname "$0")/paths.sh"
PYTHON="${PYTHON:-python3}"
PINS=(matplotlib==3.11.2 py-spy==0.4.3 sentencepiece==0.2.3)
mkdir -p "$TOOLS_CACHE"
[ -x "$TOOLS/bin/python" ] || "$PYTHON" -m venv "$TOOLS"
if ! "$TOOLS/bin/python" -c "import matplotlib, sentencepiece" 2>/dev/null || [ ! -x "$TOOLS/bin/py-spy" ]; then
  "$TOOLS/bin/pip" install -q "${PINS[@]}"
fi
SITE=$("$TOOLS/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/pagedserve-project-env.pth"
echo "tools venv ready: $TOOLS"
