#!/usr/bin/env bash
# The measurements the writeup still lacks, on a one-H200 machine, in one call of under 9 minutes.
# Steps, in this order (name some to run only those: bash tools/gpu_writeup.sh compile):
#   flash_fp32  flash_benchmarking: the fp32 cell d 128, s 65536 (ours, plain PyTorch, SDPA)
#   profile     nsys_profile: small and medium, fp32 training steps profiled at contexts 2048 to 8192;
#               a context that does not fit gives an "oom" row, so the rows show the longest that fits
#   memory      memory_profiling (a): xl forward and training step at contexts 128 and 2048 (fp32), with
#               the snapshot pickles that PyTorch's memory viewer opens
#   compile     torch_compile (b): small, medium and large in fp32 and bf16, eager then compiled (~8 min)
#   compile_xl  the same for xl (~5 min)
# Every job is its own process with its own timeout (a row is written when its job ends, so a timeout
# costs only that job); no job starts within 20 s of the deadline ($WRITEUP_DEADLINE_S after the start,
# default 520), and a running one is cut there. All steps take two calls: by default the first four, then
# `bash tools/gpu_writeup.sh compile`.
# Back under $OUT (8 files, at most one folder down): rows/{attention_flash,bench_profile,bench_kernels,
# bench_memory,bench_compile}.jsonl, figures.tar.gz (timeline PNGs, snapshot pickles), traces.tar (the
# profiler traces) and log.txt.
#   run (GPU machine, repo root): bash tools/gpu_writeup.sh; then bash tools/gpu_writeup.sh compile
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
work="$(mktemp -d)"
rows="$OUT/rows"
mkdir -p "$rows" "$work/profile" "$work/memory"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
start=$(date +%s)
deadline=$((start + ${WRITEUP_DEADLINE_S:-520}))
steps=("$@")
((${#steps[@]})) || steps=(flash_fp32 profile memory compile_xl)

# job SECONDS ARGS...: run `cs336 ARGS...` with a timeout of SECONDS, cut at the deadline.
job() {
  local limit=$1 left
  shift
  left=$((deadline - $(date +%s)))
  if ((left < 20)); then
    echo "[skip: deadline] cs336 $*"
    return 0
  fi
  ((limit < left)) || limit=$left
  echo "[job ${limit}s] cs336 $*"
  local t0=$SECONDS
  timeout -s INT -k 10 "$limit" bash tools/gpu.sh python3 -m cs336_harness.cli "$@"
  echo "[done rc=$? $((SECONDS - t0))s] cs336 $*"
}

flash_fp32() {
  job 150 attention --part flash --flash-dtypes fp32 --flash-head-dims 128 --flash-seq-lens 65536 \
    --rep-ms 10 --out "$rows/attention_flash.jsonl"
}

profile() {
  local run
  # small fits at 4096 or not at 8192, medium at 2048 or not at 4096 (its scores are 4/3 as large).
  for run in small:2048 small:4096 small:8192 medium:2048 medium:4096; do
    job 90 bench --size "${run%:*}" --context-length "${run#*:}" --attention annotated --warmup 2 --steps 2 \
      --profile "$work/profile" --out "$rows/bench_profile.jsonl"
  done
}

memory() {
  local ctx
  for ctx in 128 2048; do
    job 60 bench --size xl --context-length "$ctx" --mode forward --warmup 1 --steps 1 \
      --memory "$work/memory" --out "$rows/bench_memory.jsonl"
  done
  job 60 bench --size xl --context-length 128 --mode train --warmup 1 --steps 1 \
    --memory "$work/memory" --out "$rows/bench_memory.jsonl"
  # Without checkpointing this step runs out of memory; no warm-up, so the snapshot holds the step that fails.
  job 60 bench --size xl --context-length 2048 --mode train --warmup 0 --steps 1 \
    --memory "$work/memory" --out "$rows/bench_memory.jsonl"
}

# compile_sizes SIZE...: eager rows of every size first (the baseline of the same call), then one job per
# compiled size and dtype, so a job cut by its timeout loses only its own row.
compile_sizes() {
  local sizes=("$@") size dtype
  job 120 bench --size "$(IFS=,; echo "${sizes[*]}")" --compute-dtype fp32,bf16 --warmup 5 --steps 10 \
    --out "$rows/bench_compile.jsonl"
  for size in "${sizes[@]}"; do
    for dtype in fp32 bf16; do
      job 240 bench --size "$size" --compute-dtype "$dtype" --compile --warmup 3 --steps 10 \
        --out "$rows/bench_compile.jsonl"
    done
  done
}
compile() { compile_sizes small medium large; }
compile_xl() { compile_sizes xl; }

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  for step in "${steps[@]}"; do
    case "$step" in
      flash_fp32 | profile | memory | compile | compile_xl) echo "== step $step"; "$step" ;;
      *) echo "unknown step '$step' (expected flash_fp32, profile, memory, compile or compile_xl)"; exit 2 ;;
    esac
  done
  [ -f "$work/profile/kernels.jsonl" ] && mv "$work/profile/kernels.jsonl" "$rows/bench_kernels.jsonl"
  # Two archives, each well under the 16 MiB that one file may have: figures and snapshots, and traces.
  (cd "$work" && find . -type f \( -name '*.png' -o -name '*.pickle' \) | tar -czf "$OUT/figures.tar.gz" -T -)
  (cd "$work" && find . -type f -name 'trace_*.json.gz' | tar -cf "$OUT/traces.tar" -T -)
  ls -la "$rows" "$OUT"
  echo "total $(($(date +%s) - start)) s"
} 2>&1 | tee "$OUT/log.txt"
