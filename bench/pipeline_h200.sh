#!/usr/bin/env bash
# bench/pipeline.py on the H200 machine: 1 rank against two pipeline ranks sharing the one GPU
# (MLX's ring backend on loopback: NCCL takes one GPU per rank), with one batch in flight and
# with one per rank, on a model of Llama-3.1-8B's shape with random bf16 weights.
#
# Staging, from the project root (the device tool sends /work/main's tree):
#   rm -rf .gpu/pipeline && mkdir -p .gpu/pipeline/wt && git -C /work/wt/pipeline archive HEAD \
#     engined kernels mlxd shared bench tests/__init__.py tests/tiny_models.py | tar -x -C .gpu/pipeline/wt
# Device call 1: carry [".gpu/gpuh/a"], command: mkdir -p /root/gpu && cp .gpu/gpuh/a/* /root/gpu/
# Device call 2 (the machine still warm): carry [".gpu/gpuh/b", ".gpu/pipeline"],
#   command: bash .gpu/pipeline/wt/bench/pipeline_h200.sh
# Here, without the GPU: SHAPE=llama-tiny REQUESTS=4 bash bench/pipeline_h200.sh (the same steps, no install).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -f /root/gpu/part_aa ]; then  # on the GPU machine: MLX's CUDA wheel in two parts (mlx-cuda-wheels.sh)
  B="$ROOT/../../gpuh/b"
  WHL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  cat /root/gpu/part_aa "$B/part_ab" > "$WHL"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL" "$B"/*.whl
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" PYTHONUNBUFFERED=1
cd "$ROOT"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
python3 -m bench.pipeline --shape "${SHAPE:-llama-8b}" --configs "1 rank,1 rank sync,pipeline x2 one batch,pipeline x2" \
  --requests "${REQUESTS:-32}" --prompt-len "${PROMPT_LEN:-512}" --max-tokens "${MAX_TOKENS:-64}" \
  --num-kv-blocks "${KV_BLOCKS:-4096}" | tee "${OUT:-/tmp}/pipeline_h200.md"
