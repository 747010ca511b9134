#!/usr/bin/env bash
# Build llama.cpp's llama-server for the CPU comparison, from the llama.cpp that
# llama-cpp-python 0.3.36 vendors (its sdist from PyPI: no git, no network beyond pip's index).
#
#   benchmarks/build_llama_server.sh [BUILD_DIR]       # default: /tmp/llama-server-build
#
# Prints the path of the binary. Then, for the same GGUF as our default model, on 2 cores:
#   taskset -c 0,1 BIN -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 --port 8080 -c 4096 -np 16
# (-np: parallel slots, i.e. streams served at once; -t: threads). Needs cmake, a C++17 compiler
# and about 5 minutes of 2 cores; GGML_NATIVE=ON builds for this CPU's instruction set (AVX-512,
# AVX512-BF16, ...), as a local llama.cpp build does by default.
set -euo pipefail

VERSION=0.3.36
BUILD_DIR=${1:-/tmp/llama-server-build}
JOBS=${JOBS:-$(nproc)}

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
SDIST=$(ls llama[-_]cpp[-_]python-"$VERSION".tar.gz 2>/dev/null | head -n 1 || true)
if [ -z "$SDIST" ]; then
    python -m pip download --no-deps --no-binary :all: --dest . "llama-cpp-python==$VERSION"
    SDIST=$(ls llama[-_]cpp[-_]python-"$VERSION".tar.gz | head -n 1)
fi
TOP=$(tar -tzf "$SDIST" | awk -F/ 'NR == 1 { print $1 }')
[ -d "$TOP" ] || tar -xzf "$SDIST"
SRC="$BUILD_DIR/$TOP/vendor/llama.cpp"
test -f "$SRC/CMakeLists.txt" || { echo "no llama.cpp sources in $SRC" >&2; exit 1; }

cmake -S "$SRC" -B "$BUILD_DIR/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD_DIR/build" --target llama-server -j "$JOBS"

BIN="$BUILD_DIR/build/bin/llama-server"
test -x "$BIN" || { echo "build finished without $BIN" >&2; exit 1; }
"$BIN" --version 2>&1 | head -n 2 >&2 || true
echo "$BIN"
