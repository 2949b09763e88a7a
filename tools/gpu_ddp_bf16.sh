#!/usr/bin/env bash
# The bf16 DDP comparison repeated (about 4 minutes on a two-GPU machine): bucketed against torch DDP at the
# same bucket size (default 25 MiB), xl, context 512, global batch 4, 12 timed steps, in alternating order
# over 4 processes, so drift between runs shows up in both wrappers alike. The first process also times the
# compute-only step. Rows carry sync_tail_ms and comm_tail_ms (CUDA events, no profiler; see cs336_harness.studies.ddp).
# Results in $OUT: ddp_bf16_repeats.jsonl, log.txt. No run starts after $DDP_DEADLINE_S seconds (default 260).
#   run (GPU machine, repo root): bash tools/gpu_ddp_bf16.sh [BUCKET_MIB]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
bucket="${1:-25}"
deadline=$(($(date +%s) + ${DDP_DEADLINE_S:-260}))
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
{
  for variants in nocomm,bucketed,torch_ddp torch_ddp,bucketed bucketed,torch_ddp torch_ddp,bucketed; do
    left=$((deadline - $(date +%s)))
    if [ "$left" -lt 45 ]; then echo "[skip: deadline] $variants"; continue; fi
    timeout "$left" "${cs336[@]}" ddp --size xl --world-size 2 --context-length 512 --global-batch 4 \
      --compute-dtype bf16 --variants "$variants" --bucket-size-mb "$bucket" --warmup 2 --steps 12 \
      --out "$OUT/ddp_bf16_repeats.jsonl"
  done
} 2>&1 | grep -v -i warn | tee "$OUT/log.txt"
