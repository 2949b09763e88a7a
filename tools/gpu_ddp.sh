#!/usr/bin/env bash
# Section 5 on a two-GPU machine in one call (about 5 minutes): NCCL collectives at world sizes 1 and 2
# over 1 MiB..1 GiB, then `cs336 ddp` (xl, context 512, global batch 4) with every wrapper, fp32 and
# bf16 in separate processes so a slow one cannot take the other's rows with it.
# Results in $OUT: collectives.{jsonl,png}, ddp.jsonl, ddp_timeline_{fp32,bf16}.png, log.txt.
#   run (GPU machine, repo root): bash tools/gpu_ddp.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 45 "${cs336[@]}" collectives --backends nccl --world-sizes 1,2 --sizes-mb 1,10,100,1024 \
    --warmup 3 --iters 10 --out "$OUT/collectives.jsonl" --plot "$OUT/collectives.png"
  for dtype in fp32 bf16; do
    timeout "$([ "$dtype" = fp32 ] && echo 150 || echo 120)" "${cs336[@]}" ddp --size xl --world-size 2 --context-length 512 --global-batch 4 \
      --compute-dtype "$dtype" --warmup 2 --steps 8 --out "$OUT/ddp.jsonl" --figure-dir "$OUT"
  done
} 2>&1 | tee "$OUT/log.txt"
