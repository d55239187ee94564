#!/usr/bin/env bash
# Every GPU measurement the open issues wait for, in one call on a CUDA machine, most wanted first, each
# under its own time limit so that one slow or failing benchmark leaves the others their time. MLX with
# its CUDA backend must be importable. Logs go to $OUT (default bench/results/gpu_suite); a benchmark's
# rows are written as they come, so a cut run keeps what it measured.
#   bash bench/gpu_suite.sh [timeline split_device]   (default: these, in that order, what issue 26's
#   last question waits for; also: graph_limits device_step compiled serving_c1 hoststep mtp pipeline lora
#   probe serving gdn hybrid_probe mtp_c16 pipeline_dtype ttft_http skinny, runs measured before)
# BUDGET_S (default 1140) is the whole run's limit; a step gets what is left, up to its own cap.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" PYTHONUNBUFFERED=1
OUT="${OUT:-$ROOT/bench/results/gpu_suite}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S="${BUDGET_S:-1140}"
step() {  # step NAME CAP_S COMMAND...: run COMMAND under min(CAP_S, what is left), log to $OUT/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then echo "== $name: skipped, ${left}s left"; return; fi
  echo "== +$(( $(date +%s) - T0 ))s $name (limit ${cap}s)"
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$? ($(( $(date +%s) - T0 ))s)"; tail -n 14 "$OUT/$name.log"
}
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' || exit 1
for what in ${@:-timeline split_device}; do
  case $what in
    lora)  # issue 22: 4 adapters against the base at c=8 and 64 (target >= 0.8x)
      step lora_term 60 python3 -m bench.lora --shape llama-8b --term --step-repeats 20
      step lora 150 python3 -m bench.lora --shape llama-8b --levels 8 64 --max-tokens 32 --prompt-lens 64 256 \
        --repeats 1 --step-repeats 5
      step lora_qv 120 python3 -m bench.lora --shape llama-8b --levels 8 64 --max-tokens 32 --prompt-lens 64 256 \
        --repeats 1 --step-repeats 5 --targets q_proj v_proj ;;
    mtp)  # issue 21: the speed-up against acceptance, and the proposal's cost
      step mtp 240 python3 -m bench.speculative --method mtp --shape qwen3_5-8b --levels 1 4 16 --k 3 \
        --p 0 0.5 0.7 0.9 1 --max-tokens 64 --prompt-tokens 256
      step mtp_propose 90 python3 -m bench.speculative_propose --shape qwen3_5-8b --levels 1 16 --ks 1 2 3 4 ;;
    gdn)  # the CUDA gated-delta kernel against mlx_lm's loop: equal, then faster (hybrid prefill, MTP windows)
      step gdn_check 120 python3 -m bench.kernels.gated_delta_check ;;
    hybrid_probe)  # issue 21: which layers make a hybrid's verification step 3-4x a plain one at c >= 4
      step hybrid_probe 240 python3 -m bench.hybrid_step_probe --shape qwen3_5-8b --levels 1 4 16 --k 3 --p 0 1 ;;
    mtp_c16)  # issue 21: the curve at c = 16, fewer acceptance points (the default step ends during c = 4)
      step mtp_c16 300 python3 -m bench.speculative --method mtp --shape qwen3_5-8b --levels 16 --k 3 \
        --p 0 0.7 1 --max-tokens 64 --prompt-tokens 256 ;;
    pipeline_dtype)  # issue 23: do two batches in flight change outputs in float32 too, or only by bf16 rounding?
      for dtype in float32 bfloat16; do
        step "pipeline_$dtype" 150 python3 -m bench.pipeline --shape llama-1b --dtype $dtype \
          --configs "1 rank,pipeline x2 one batch,pipeline x2" --requests 32 --prompt-len 512 --max-tokens 64 \
          --num-kv-blocks 4096
      done ;;
    serving_c1)  # issue 26: c = 1 and 16 on mixed bf16 prompts, the ratios the host time decides
      step serving_c1 240 python3 -m bench.gpu_serving --model qwen3-8b --dtype bf16 --workloads mixed \
        --concurrency 1,16 --modes async --repeats 2 --out "$OUT/serving.jsonl" ;;
    probe)  # issue 26: where a c=1 / c=16 decode step's time goes, against mlx_lm's
      step probe 180 python3 -m bench.gpu_step_probe ;;
    pipeline)  # issue 23: two ranks sharing the GPU against one
      step pipeline 300 env SHAPE=llama-8b REQUESTS=32 MAX_TOKENS=64 OUT="$OUT" bash bench/pipeline_h200.sh ;;
    serving)  # issue 26: the ratios still unmeasured (4-bit, shared prefix, c=128, MoE)
      step serving_q4 240 python3 -m bench.gpu_serving --model qwen3-8b --dtype q4 --workloads mixed \
        --concurrency 1,16,64 --repeats 2 --out "$OUT/serving.jsonl"
      step serving_bf16 300 python3 -m bench.gpu_serving --model qwen3-8b --dtype bf16 --workloads mixed,shared \
        --concurrency 1,16,128 --modes async --repeats 1 --out "$OUT/serving.jsonl"
      step serving_moe 240 python3 -m bench.gpu_serving --model qwen3-30b-a3b --dtype q4 --workloads mixed \
        --concurrency 1,16,64 --modes async --repeats 1 --out "$OUT/serving.jsonl" ;;
    ttft_http)  # issue 48: mlxd serve against mlx_lm.server over HTTP, bf16 and 4-bit, Poisson at 2 and 8 a second
      step ttft_http 570 python3 -m bench.gpu_http --rates 2,8 --num-prompts 32,64 --out "$OUT" ;;
    skinny)  # issue 26: a few-row GEMM of our own against cuBLASLt's host cost per matmul (c = 16's steps)
      step skinny 150 python3 bench/kernels/skinny_gemm.py --rows 2 8 16 --npw 4 8 ;;
    compiled)  # issue 26: decode steps replayed from compiled traces against built in Python, and the
      # device's own step time beside them (host time a step well under the device's at c = 64)
      step compiled 300 python3 -m bench.gpu_step_ab --compare compiled --levels 1,16,64 --rounds 4 \
        --out "$OUT/step_ab.jsonl"
      step device_step 180 python3 -m bench.gpu_device_step --levels 16,64 --out "$OUT/device_step.jsonl"
      step lean_graph 240 python3 -m bench.gpu_step_ab --compare lean-graph --levels 16,64 --rounds 4 \
        --out "$OUT/step_ab.jsonl" ;;
    graph_limits)  # issue 26: does MLX's commit rule bound a c = 64 step? MLX's CUDA back-end closes a
      # CUDA graph every 100 kernels or 1000 MB of inputs on an H200, counting a whole K/V pool (and
      # weight) each time a kernel reads it, and stops encoding while more than 10 graphs are in flight;
      # a step reads ~36 GB that way (~35 graphs) with 4096 blocks, and more with a larger pool
      for blocks in 4096 16384; do
        for mb in 1000 1000000; do  # 1000: MLX's own limit on an H200
          step "limits_${blocks}_$mb" 90 env MLX_MAX_MB_PER_BUFFER=$mb python3 -m bench.gpu_step_ab \
            --compare compiled --levels 64 --rounds 3 --num-kv-blocks $blocks --out "$OUT/limits_${blocks}_$mb.jsonl"
        done
      done ;;
    timeline)  # issue 26: a served decode step's device and host events on one clock (does the device wait?)
      step timeline 240 python3 -m bench.gpu_step_timeline --levels 16,64 --out "$OUT/timeline.jsonl" ;;
    split_device)  # issue 26: a served c = 64 step keeps the device busy ~11 ms, the same step queued whole
      # behind a spin as one graph 8.5 ms: is it the step's split into graphs? Held behind the spin as ~7
      # graphs (fewer than the ten MLX lets be in flight), and as direct launches; then served, the same ways
      step held_one 150 python3 -m bench.gpu_device_step --levels 64 --out "$OUT/held_one.jsonl"
      step held_ops150 90 env MLX_MAX_OPS_PER_BUFFER=150 MLX_MAX_MB_PER_BUFFER=1000000 \
        python3 -m bench.gpu_device_step --levels 64 --out "$OUT/held_ops150.jsonl"
      step timeline_ops150 90 env MLX_MAX_OPS_PER_BUFFER=150 MLX_MAX_MB_PER_BUFFER=1000000 \
        python3 -m bench.gpu_step_timeline --levels 64 --out "$OUT/timeline_ops150.jsonl"
      step held_direct 90 env MLX_USE_CUDA_GRAPHS=0 python3 -m bench.gpu_device_step --levels 64 \
        --out "$OUT/held_direct.jsonl"
      step timeline_direct 90 env MLX_USE_CUDA_GRAPHS=0 python3 -m bench.gpu_step_timeline --levels 64 \
        --out "$OUT/timeline_direct.jsonl" ;;
    device_step)  # issue 26: the device's time a step against the engine's host time, the device held
      step device_step 150 python3 -m bench.gpu_device_step --levels 16,64 --out "$OUT/device_step.jsonl" ;;
    hoststep)  # issue 26: the host part of a step with the real kernels
      step host_step 180 python3 -m bench.host_step --concurrency 1,16,64 --async --compile ;;
    *) echo "unknown: $what (timeline split_device graph_limits device_step compiled serving_c1 hoststep mtp pipeline lora probe serving gdn hybrid_probe mtp_c16 pipeline_dtype ttft_http skinny)"; exit 2 ;;
  esac
done
echo "== done in $(( $(date +%s) - T0 ))s; logs in $OUT"
