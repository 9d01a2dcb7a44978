#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (parallel slots, continuous batching) from the llama.cpp sources
# inside the llama-cpp-python sdist, for `make loadtest-compare`. Takes ~8 minutes of both cores.
# Built for this CPU, in a folder keyed by the CPU's flags, so a binary built on one host is never run on
# another that lacks its instructions: -DGGML_NATIVE=ON, except on a CPU with AMX, whose features are named
# one by one with AMX left out (llama.cpp's AMX code crashed there when built by GCC 12). The web UI is not
# built (it would be downloaded). The sdist comes through pip's own configured index.
# ATTNSERVE_ISA=avx2 builds for AVX2/FMA only (no AVX-512), as for an AVX2-only host: with the same
# variable attnserve withholds AVX-512 from its own kernels (docs/performance.md, "emulated AVX2 host").
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${ATTNSERVE_HOME:-$HOME/.cache/attnserve}/llama.cpp"
PY="${PY:-.venv/bin/python}"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ')"
ISA="${ATTNSERVE_ISA:-native}"
HOST_KEY="$(printf '%s %s' "$(uname -m)" "$FLAGS" | sha256sum | cut -c1-12)"
[ "$ISA" = native ] || HOST_KEY="$HOST_KEY-$ISA"
DEST="$ROOT/build-$HOST_KEY"
NO_AMX=0
[ "$ISA" = native ] && grep -qw amx_tile /proc/cpuinfo && NO_AMX=1 && DEST="$DEST-noamx"
BIN="$DEST/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v cmake >/dev/null || { echo "cmake is needed: apt-get install -y cmake g++" >&2; exit 2; }
mkdir -p "$ROOT/src"
SDIST="$ROOT/src/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "downloading the llama-cpp-python $VERSION sdist (pip download --no-binary :all: --no-deps) ..." >&2
  "$PY" -m pip download -q --no-binary :all: --no-deps -d "$ROOT/src" "llama-cpp-python==$VERSION" >&2
fi
[ -d "$ROOT/src/llama_cpp_python-$VERSION" ] || tar -xzf "$SDIST" -C "$ROOT/src"
SRC="$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
CPU=(-DGGML_NATIVE=ON)
if [ "$ISA" = avx2 ]; then
  CPU=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
       -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
elif [ "$ISA" != native ]; then
  echo "ATTNSERVE_ISA=$ISA: only avx2 (or unset) is supported here" >&2; exit 2
fi
if [ "$NO_AMX" = 1 ]; then
  # -march=native defines __AMX_INT8__ whatever GGML_AMX_* say, and that code crashed (SIGSEGV at its
  # threadpool init, SIGILL before): name this CPU's own features one by one instead, AMX left out.
  has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw -- "$1" && echo ON || echo OFF; }
  CPU=(-DGGML_NATIVE=OFF -DGGML_SSE42="$(has sse4_2)" -DGGML_F16C="$(has f16c)" -DGGML_FMA="$(has fma)"
       -DGGML_BMI2="$(has bmi2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
       -DGGML_AVX512="$(has avx512bw)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
       -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
echo "building llama-server for this CPU in $DEST ($ISA) ..." >&2
cmake -S "$SRC" -B "$DEST" -DCMAKE_BUILD_TYPE=Release "${CPU[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF >&2
# libllama.so too: the llama-cpp-python server (setup_llama_cpp_python.sh) loads it instead of compiling
# llama.cpp a second time.
cmake --build "$DEST" --target llama-server llama -j "$(nproc)" >&2
echo "$BIN"
