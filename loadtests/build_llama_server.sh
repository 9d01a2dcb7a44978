#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (parallel slots, continuous batching) from the llama.cpp sources
# inside the llama-cpp-python sdist on PyPI, for `make loadtest-compare`. Takes ~8 minutes of both cores.
# -DGGML_NATIVE=OFF with explicit AVX-512 flags: -march=native crashes (SIGILL) in llama.cpp's AMX code
# with GCC 12 on this CPU. The web UI is not built (it would be downloaded).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${ATTNSERVE_HOME:-$HOME/.cache/attnserve}/llama.cpp"
PY="${PY:-.venv/bin/python}"
BIN="$DEST/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v cmake >/dev/null || { echo "cmake is needed: apt-get install -y cmake g++" >&2; exit 2; }
mkdir -p "$DEST/src"
"$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DEST/src"
tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
  -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
echo "$BIN"
