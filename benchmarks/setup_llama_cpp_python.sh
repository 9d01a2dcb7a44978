#!/usr/bin/env bash
# Makes llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) runnable for
# `make loadtest-compare`, without compiling llama.cpp a second time: the Python package comes from the
# same llama-cpp-python sdist that build_llama_server.sh builds llama-server from, and its `lib/` holds
# links to the shared libraries that build produced (libllama, libggml*). Its server dependencies go
# into a venv of their own (never the project's). Prints the venv's python.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${ATTNSERVE_HOME:-$HOME/.cache/attnserve}/llama.cpp"
PYTHON="${PYTHON:-python3}"
SRC="$DEST/src/llama_cpp_python-$VERSION"
VENV="$DEST/py-venv"
[ -d "$SRC/llama_cpp" ] || { echo "run benchmarks/build_llama_server.sh first ($SRC missing)" >&2; exit 2; }
BIN_DIR="$(dirname "$(bash "$(dirname "$0")/build_llama_server.sh")")"  # this host's build (no-op when built)
ls "$BIN_DIR/"libllama.so* >/dev/null 2>&1 || { echo "libllama.so not built: run build_llama_server.sh" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "uvicorn>=0.22" "fastapi>=0.100" "pydantic-settings>=2.0.1" \
    "sse-starlette>=1.6.1" "starlette-context>=0.3.6,<0.4" "PyYAML>=5.1" "numpy>=1.20" "diskcache>=5.6.1" \
    "jinja2>=2.11.3" "typing-extensions>=4.5"
fi
PKG="$DEST/py/llama_cpp"
rm -rf "$PKG"; mkdir -p "$DEST/py"; cp -r "$SRC/llama_cpp" "$PKG"; mkdir -p "$PKG/lib"
for f in "$BIN_DIR/"lib*.so*; do ln -sf "$f" "$PKG/lib/"; done
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$DEST/py" > "$SITE/llama_cpp_src.pth"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)" >&2
echo "$VENV/bin/python"
