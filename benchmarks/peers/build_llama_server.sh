#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the sources vendored in the llama-cpp-python sdist,
# into the peers cache (never in CI). Niced and -j2 because the 2 cores are shared.
# --no-amx: a second build (llama-build-noamx) naming AVX-512/VNNI/BF16 instead of -march=native, for VMs that list
# AMX but do not grant its tile state, where the native build dies of SIGILL; the harness falls back to it.
set -euo pipefail
. "$(dirname "$0")/paths.sh"
VERSION=0.3.36
SRC="$CACHE/llama-cpp-python-$VERSION"
BUILD="$CACHE/llama-build"
ISA=(-DGGML_NATIVE=ON)
if [ "${1:-}" = "--no-amx" ]; then
  BUILD="$CACHE/llama-build-noamx"
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON)
fi
JOBS="${JOBS:-2}"
mkdir -p "$CACHE"
if [ -x "$BUILD/bin/llama-server" ]; then echo "llama-server already built: $BUILD/bin/llama-server"; exit 0; fi
if [ ! -d "$SRC" ]; then
  "${PYTHON:-python3}" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  [ -d "$SRC" ] || mv "$CACHE/llama_cpp_python-$VERSION" "$SRC"
fi
nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  "${ISA[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build "$BUILD" --target llama-server -j "$JOBS"
ls -la "$BUILD/bin/llama-server"
