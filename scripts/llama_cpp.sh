#!/usr/bin/env bash
# Build llama.cpp's llama-perplexity and llama-tokenize from the source llama-cpp-python 0.3.36 vendors (a pinned
# sdist from PyPI), once, into .cache/llama.cpp/0.3.36; install that sdist's Python binding without a library of its
# own (-DLLAMA_BUILD=OFF: seconds), to load the libllama.so built here (LLAMA_CPP_LIB_PATH=the folder); print the
# folder. tests/test_llama_cpp.py runs the tools on hexq's GGUF exports (HEXQ_LLAMA_CPP_BIN), the export's own check
# (hexq.export.gguf.check) runs llama.cpp through the binding; .ci/run calls this first. About 4 minutes on 2 cores.
# With --bench, llama-bench, llama-quantize and llama-imatrix too (the benchmarks' peers: engines.py, head.py,
# gguf_quality.py; a minute more).
set -euo pipefail
TOOLS="llama-perplexity llama-tokenize"
case "${1:-}" in
    "") ;;
    --bench) TOOLS="$TOOLS llama-bench llama-quantize llama-imatrix" ;;
    *) echo "error: unknown argument '$1' (usage: scripts/llama_cpp.sh [--bench])" >&2; exit 2 ;;
esac
VERSION=0.3.36
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.cache/llama.cpp/$VERSION"
SRC="$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
binding() {
    if ! LLAMA_CPP_LIB_PATH="$BIN" "$PYTHON" -c "import llama_cpp" 2>/dev/null; then
        CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PYTHON" -m pip install --quiet "$DEST/llama_cpp_python-$VERSION.tar.gz" >&2
        LLAMA_CPP_LIB_PATH="$BIN" "$PYTHON" -c "import llama_cpp" >&2
    fi
}
built() {
    for tool in $TOOLS; do [ -x "$BIN/$tool" ] || return 1; done
    [ -f "$BIN/libllama.so" ]
}
if built; then
    binding
    echo "$BIN"
    exit 0
fi
command -v cmake >/dev/null || { echo "error: cmake is needed to build llama.cpp's tools" >&2; exit 1; }
mkdir -p "$DEST"
if [ ! -d "$SRC" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST" >&2
    tar xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
fi
# ggml's AMX matmul crashed with SIGILL on the Intel CPUs hexq is tested on: build without it there.
FLAGS=""
if grep -q "amx" /proc/cpuinfo 2>/dev/null; then FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" >&2
# shellcheck disable=SC2086 # TOOLS: one word per target
cmake --build "$SRC/build" -j"$(nproc)" --target $TOOLS llama >&2
binding
echo "$BIN"
