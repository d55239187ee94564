#!/usr/bin/env bash
# bench/pipeline.py on a one-GPU machine: 1 rank against two pipeline ranks sharing the GPU (MLX's
# ring backend on loopback: NCCL takes one GPU per rank), with one batch in flight and with one per
# rank, on a model of Llama-3.1-8B's shape with random bf16 weights. MLX (with its CUDA backend)
# must be importable. Without a GPU, the same steps: SHAPE=llama-tiny REQUESTS=4 bash bench/pipeline_h200.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" PYTHONUNBUFFERED=1
cd "$ROOT"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
python3 -m bench.pipeline --shape "${SHAPE:-llama-8b}" --configs "1 rank,1 rank sync,pipeline x2 one batch,pipeline x2" \
  --requests "${REQUESTS:-32}" --prompt-len "${PROMPT_LEN:-512}" --max-tokens "${MAX_TOKENS:-64}" \
  --num-kv-blocks "${KV_BLOCKS:-4096}" | tee "${OUT:-/tmp}/pipeline_h200.md"
