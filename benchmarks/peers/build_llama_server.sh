#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize from the sources vendored in the llama-cpp-python sdist
# (downloaded once from PyPI into the peers cache), never in CI. Niced and -j2 because the 2 cores are shared.
# Usage: build_llama_server.sh [native|avx2]   (default native; both builds live side by side in the cache)
#        build_llama_server.sh --no-amx-flags   (prints the flags a native build adds where AMX is refused)
#   native: -march=native, the peer at its best on this host. Where the CPU lists AMX but this process may not run
#           tile code (amx_probe.c fails: a VM that refuses the tile state, where the AMX build dies of SIGILL), the
#           AMX ISA flags are switched off (-mno-amx-*) so ggml compiles no AMX code; everything else stays native,
#           weight repacking included. --no-repack is never the answer: it also turns the repacked kernels off.
#   avx2:   the AVX2 tier on any x86-64 host: AVX2 + FMA + F16C (+BMI2), every AVX-512, AVX-VNNI and AMX option off.
# Each build writes pagedserve-build.json beside bin/ (tier, cmake ISA flags, AMX probe result, compiler), which
# the harness copies into every result.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/paths.sh"
VERSION=0.3.36
TIER="${1:-native}"
SRC="$CACHE/llama-cpp-python-$VERSION"
BUILD="$CACHE/llama-build-$TIER"
JOBS="${JOBS:-2}"
CC_BIN="${CC:-cc}"
mkdir -p "$CACHE"

# every AMX extension the compiler's -march=native turns on, switched off again (gcc applies -mno-* over -march
# whatever their order)
no_amx_flags() {
  "$CC_BIN" -march=native -Q --help=target | awk '$1 ~ /^-mamx-/ && $2 == "[enabled]" {
    sub(/^-m/, "-mno-", $1); printf "%s ", $1 }'
}

amx_ok() {
  grep -qw amx_tile /proc/cpuinfo || return 1
  "$CC_BIN" -O1 -mamx-tile -mamx-int8 -o "$CACHE/amx-probe" "$HERE/amx_probe.c" || return 1
  "$CACHE/amx-probe"
}

AMX="not listed"
case "$TIER" in
  --no-amx-flags) no_amx_flags; echo; exit 0 ;;  # what a native build adds where AMX is refused (tests use it)
  native)
    ISA=(-DGGML_NATIVE=ON)
    EXTRA=""
    if grep -qw amx_tile /proc/cpuinfo; then
      # PAGEDSERVE_LLAMA_AMX=off: where the probe passes yet ggml's AMX kernels crash (seen on an SPR Firecracker VM:
      # SIGSEGV in ggml_backend_amx_mul_mat at warm-up), the harness's error names this switch
      if [ "${PAGEDSERVE_LLAMA_AMX:-auto}" != off ] && amx_ok; then AMX="usable"; else
        AMX="listed, refused (probe) or switched off (PAGEDSERVE_LLAMA_AMX=${PAGEDSERVE_LLAMA_AMX:-auto})"
        # every AMX extension the compiler's -march=native turns on, switched off again (order does not matter)
        EXTRA=$(no_amx_flags)
        echo "AMX listed but refused here: building native without it ($EXTRA)"
      fi
    fi
    ISA+=("-DCMAKE_C_FLAGS=$EXTRA" "-DCMAKE_CXX_FLAGS=$EXTRA")
    ;;
  avx2)
    ISA=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
         -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
         -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    ;;
  *) echo "usage: $0 [native|avx2]" >&2; exit 2 ;;
esac

if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-quantize" ] && [ -s "$BUILD/pagedserve-build.json" ]; then
  echo "llama.cpp ($TIER) already built: $BUILD/bin"; exit 0
fi
if [ ! -d "$SRC" ]; then
  "${PYTHON:-python3}" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  [ -d "$SRC" ] || mv "$CACHE/llama_cpp_python-$VERSION" "$SRC"
fi
nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  "${ISA[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_CCACHE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS"
FLAGS=$(printf '"%s", ' "${ISA[@]}")
cat > "$BUILD/pagedserve-build.json" <<EOF
{"tier": "$TIER", "source": "llama-cpp-python $VERSION sdist (vendor/llama.cpp)",
 "cmake_isa_flags": [${FLAGS%, }], "amx": "$AMX",
 "compiler": "$("$CC_BIN" --version | head -1)", "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"}
EOF
ls -la "$BUILD/bin/llama-server" "$BUILD/bin/llama-quantize"
