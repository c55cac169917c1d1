#!/usr/bin/env bash
# Converts an HF folder to f32 and bf16 GGUF for llama-server with the converter shipped
# in the llama-cpp-python sdist (and its own gguf-py, so versions match the server).
# Usage: convert_gguf.sh MODEL_DIR [OUT_DIR]   (build_llama_server.sh unpacks the sdist,
# install_tools.sh makes the venv it runs in)
set -euo pipefail
. "$(dirname "$0")/paths.sh"
MODEL="${1:?usage: convert_gguf.sh MODEL_DIR [OUT_DIR]}"
OUT="${2:-$CACHE/gguf}"
LLAMA="$CACHE/llama-cpp-python-0.3.36/vendor/llama.cpp"
[ -f "$LLAMA/convert_hf_to_gguf.py" ] || { echo "run build_llama_server.sh first (no $LLAMA)"; exit 1; }
mkdir -p "$OUT"
# The converter imports sentencepiece even for BPE vocabularies (it probes for a tokenizer.model first):
# it runs under the tools venv, where install_tools.sh pins it (never into the user's own pip).
[ -x "$TOOLS/bin/python" ] || { echo "run install_tools.sh first (no $TOOLS)"; exit 1; }
NAME=$(basename "$MODEL")
for TYPE in f32 bf16; do
  DEST="$OUT/$NAME-$TYPE.gguf"
  if [ -s "$DEST" ] && [ "$DEST" -nt "$MODEL/config.json" ]; then echo "have $DEST"; continue; fi
  PYTHONPATH="$LLAMA/gguf-py:$LLAMA" nice -n 10 "$TOOLS/bin/python" "$LLAMA/convert_hf_to_gguf.py" "$MODEL" \
    --outtype "$TYPE" --outfile "$DEST.tmp"
  mv "$DEST.tmp" "$DEST"
  echo "wrote $DEST"
done
