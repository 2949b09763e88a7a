#!/usr/bin/env bash
# The leaderboard step on a two-GPU machine in one call (under 9 minutes in all): the leaderboard GPU tests
# (sharded step against one process on NCCL; a small bf16 run), then `cs336 leaderboard` with its defaults
# (8B, vocabulary 151936, context 32768, global batch 2, bf16, Triton attention, checkpointing every block,
# fused LM head loss, our FusedAdamW), then one ablation per piece while time is left: SDPA instead of the
# Triton attention, torch's fused AdamW instead of ours. Each run is its own process with its own timeout
# and --time-limit-s, so a slow one cannot take the others' rows with it.
# Results in $OUT: leaderboard.jsonl (one row per run), log.txt.
#   run (GPU machine, repo root): bash tools/gpu_leaderboard.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu_out}"
mkdir -p "$OUT"
deadline=$(($(date +%s) + ${LEADERBOARD_DEADLINE_S:-520}))
left() { echo $((deadline - $(date +%s))); }
cs336=(bash tools/gpu.sh python3 -m cs336_harness.cli)
run_leaderboard() {  # run_leaderboard NAME [FLAGS...]: skipped when under 90 s are left
  local name="$1"; shift
  if [ "$(left)" -lt 90 ]; then echo "[skip: deadline] $name"; return; fi
  local limit=$(($(left) - 20))
  [ "$limit" -gt 240 ] && limit=240
  echo "== $name (time limit ${limit} s)"
  timeout $((limit + 15)) "${cs336[@]}" leaderboard --time-limit-s "$limit" --out "$OUT/leaderboard.jsonl" "$@"
}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  timeout 150 bash tools/gpu.sh python3 -m pytest -m gpu packages/harness/tests/test_leaderboard.py -q \
    -p no:cacheprovider
  run_leaderboard "leaderboard (defaults)"
  run_leaderboard "ablation: sdpa attention" --attention sdpa
  run_leaderboard "ablation: torch AdamW (fused=True)" --optimizer torch-adamw
  ls -la "$OUT"
} 2>&1 | tee "$OUT/log.txt"
