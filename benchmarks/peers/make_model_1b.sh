#!/usr/bin/env bash
# The 1B-shaped model's GGUF files, made with llama.cpp's own tools (never in CI): model_1b.py writes the HF folder,
# llama.cpp's convert_hf_to_gguf.py turns it into a bf16 GGUF, llama-quantize (the native build's; the files do not
# depend on the ISA) into Q4_0, Q4_1, Q4_K_M and Q8_0. All under the peers cache; existing files are kept.
# Needs: build_llama_server.sh (native) and install_tools.sh first. Usage: [PYTHON=...] make_model_1b.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/paths.sh"
PYTHON="${PYTHON:-python3}"
LLAMA="$CACHE/llama-cpp-python-0.3.36/vendor/llama.cpp"
QUANTIZE="$CACHE/llama-build-native/bin/llama-quantize"
[ -f "$LLAMA/convert_hf_to_gguf.py" ] || { echo "run build_llama_server.sh first (no $LLAMA)"; exit 1; }
[ -x "$QUANTIZE" ] || { echo "run build_llama_server.sh native first (no $QUANTIZE)"; exit 1; }
[ -x "$TOOLS/bin/python" ] || { echo "run install_tools.sh first (no $TOOLS)"; exit 1; }
MODEL=$(cd /tmp && nice -n 10 "$PYTHON" -P "$HERE/model_1b.py")
NAME=$(basename "$MODEL")
OUT="$CACHE/gguf"
mkdir -p "$OUT"
BF16="$OUT/$NAME-bf16.gguf"
if [ ! -s "$BF16" ]; then
  PYTHONPATH="$LLAMA/gguf-py:$LLAMA" nice -n 10 "$TOOLS/bin/python" "$LLAMA/convert_hf_to_gguf.py" "$MODEL" \
    --outtype bf16 --outfile "$BF16.tmp"
  mv "$BF16.tmp" "$BF16"
fi
for TYPE in Q4_0 Q4_1 Q4_K_M Q8_0; do
  DEST="$OUT/$NAME-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf"
  [ -s "$DEST" ] && { echo "have $DEST"; continue; }
  nice -n 10 "$QUANTIZE" "$BF16" "$DEST.tmp" "$TYPE" "${JOBS:-2}"
  mv "$DEST.tmp" "$DEST"
done
ls -la "$OUT/$NAME"-*.gguf
