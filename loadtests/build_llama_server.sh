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
# The sdist straight from PyPI's simple index, checked against its sha256 (`pip download --no-binary`
# would first build every build dependency from source, which takes far longer than the download).
"$PY" - "$VERSION" "$DEST/src" <<'PYEOF'
import hashlib, re, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/", timeout=60).read().decode()
name = f"llama_cpp_python-{version}.tar.gz"
m = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', index)
if not m:
    sys.exit(f"{name} not found on PyPI's simple index")
data = urllib.request.urlopen(m.group(1), timeout=600).read()
if hashlib.sha256(data).hexdigest() != m.group(2):
    sys.exit(f"{name}: sha256 mismatch")
open(f"{dest}/{name}", "wb").write(data)
print(f"downloaded {name} ({len(data) / 1e6:.1f} MB)")
PYEOF
tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
  -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
# libllama.so too: the llama-cpp-python server (see loadtests/llama_cpp_python_server.sh) loads it through
# LLAMA_CPP_LIB_PATH instead of compiling llama.cpp a second time.
cmake --build "$DEST/build" --target llama-server llama -j "$(nproc)"
echo "$BIN"
