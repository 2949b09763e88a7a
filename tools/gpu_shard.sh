#!/usr/bin/env bash
# Sections 6-7 on a two-GPU machine in one call (about 2 minutes): the sharding GPU tests (FSDP and the
# sharded optimizer on NCCL against single-process training), then `cs336 shard` (xl, context 512, global
# batch 4; ddp, zero1, our FSDP, FSDP2), bf16 first and fp32 second, each in its own process so a slow
# one cannot take the other's rows with it. No step starts after $SHARD_DEADLINE_S seconds (default 150).
# Results in $OUT: shard.jsonl, fsdp_timeline_{bf16,fp32}.png, the bf16 profiler traces of our FSDP and
# FSDP2 (shard_bf16_{fsdp,fsdp2}.json.gz), log.txt.
#   run (GPU machine, repo root): bash tools/gpu_shard.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
traces="$(mktemp -d)"
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${SHARD_DEADLINE_S:-150}))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 45 bash tools/gpu.sh python3 -m pytest -m gpu packages/sharding -q -p no:cacheprovider
  for dtype in bf16 fp32; do
    if [ "$(left)" -lt 30 ]; then echo "[skip: deadline] shard $dtype"; continue; fi
    timeout "$(left)" "${cs336[@]}" shard --size xl --world-size 2 --context-length 512 --global-batch 4 \
      --compute-dtype "$dtype" --warmup 2 --steps 5 --trace-dir "$traces" --out "$OUT/shard.jsonl" \
      --figure "$OUT/fsdp_timeline_$dtype.png"
  done
  for variant in fsdp fsdp2; do
    trace="$traces/shard_bf16_$variant.json"
    [ -f "$trace" ] && gzip -c "$trace" >"$OUT/shard_bf16_$variant.json.gz"
  done
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
